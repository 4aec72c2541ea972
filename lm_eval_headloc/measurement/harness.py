"""What a measurement sets on lm-eval around its calls: prompt templates compiled once,
the harness's own bars quiet, lm-eval's seeds, the knockout scale and the batch size for a
block of calls, the example subset chosen once, and the tasks' few-shot settings."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

__all__ = ["FEWSHOT_SEED", "at_scale", "batching", "choose_subset", "configure_tasks",
           "quiet_harness", "seed_as_lm_eval", "templates_compiled_once"]


FEWSHOT_SEED = DEFAULT_OTHER_SEED  # lm-eval's default fewshot_random_seed


# Modules whose per-call progress bars would print hundreds of times in a run.
_HARNESS_TQDM_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


@functools.lru_cache(maxsize=4096)
def _compiled(env: Any, template: str) -> Any:
    return env.from_string(template)


def _apply_template(template: str, doc: dict) -> str:
    """``lm_eval.utils.apply_template``, compiling each template string once."""
    from lm_eval import utils

    return _compiled(utils.env, template).render(**doc)


@contextlib.contextmanager
def templates_compiled_once() -> Iterator[None]:
    """Inside, lm-eval renders its Jinja prompt templates from one compiled copy each.

    ``lm_eval.utils.apply_template`` compiles the template string on every call: every
    document's prompt, target and choices, in every measurement (each ``evaluate`` builds
    its requests and scores them anew). On a 100-document MMLU-shaped task that was most
    of lm-eval's part of a measurement: 30 ms, 7 ms compiled once (on the CPU here; a 1B
    model's forward passes take 165 ms on an H100). The rendered text is the same: one
    environment, one template string, and ``render`` keeps no state.
    """
    from lm_eval import utils

    original = utils.apply_template
    utils.apply_template = _apply_template
    try:
        yield
    finally:
        utils.apply_template = original


@contextlib.contextmanager
def quiet_harness(verbose: bool = False) -> Iterator[None]:
    """Silence lm-eval's logging and progress bars for one measurement.

    lm-eval gives no switch for the bars of ``build_all_requests`` and the model
    calls made by ``evaluate``, so their module-level ``tqdm`` is swapped for a
    disabled one while the measurement runs, and put back after.
    """
    if verbose:
        yield
        return
    from tqdm import tqdm

    def silent_tqdm(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    logger = logging.getLogger("lm_eval")
    level = logger.level
    modules = [importlib.import_module(name) for name in _HARNESS_TQDM_MODULES]
    originals = [module.tqdm for module in modules]
    logger.setLevel(logging.ERROR)
    for module in modules:
        module.tqdm = silent_tqdm
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.tqdm = original
        logger.setLevel(level)


@contextlib.contextmanager
def at_scale(lm: Any, scale: float | None) -> Iterator[None]:
    """Inside, ``lm`` (an ``HFHeadAblateLM``) knocks heads out at ``scale`` (None: as it
    does): one loaded model measures a set erased (0) and enhanced (2) side by side. The
    model reads its ``scale`` whenever a knockout starts (``knocking_out``)."""
    if scale is None:
        yield
        return
    from lm_eval_headloc.intervention.ablation import check_scale

    saved, lm.scale = lm.scale, check_scale(scale)
    try:
        yield
    finally:
        lm.scale = saved


@contextlib.contextmanager
def batching(lm: Any, rows: int | None) -> Iterator[None]:
    """Inside, HFLM (``lm``) batches its requests by ``rows`` (None: as it does)."""
    if rows is None:
        yield
        return
    saved, lm.batch_size_per_gpu = lm.batch_size_per_gpu, rows
    try:
        yield
    finally:
        lm.batch_size_per_gpu = saved


def choose_subset(doc_counts: dict[str, int], num_samples: int | None,
                  seed: int, part: tuple[int, int] | None = None
                  ) -> dict[str, list[int]] | None:
    """The same ``num_samples`` document indices per leaf task for every measurement.

    Drawn without replacement with ``seed`` (sorted, for readable run folders); a task
    with fewer documents uses all of them. ``None`` means every document. ``part``
    ``(k, n)``: drawn from the k-th of n disjoint parts of the task's documents (a seeded
    shuffle cut in n), so runs on parts 1/2 and 2/2 with the same seed share no example
    (CNL's check of a located set across disjoint subsamples).
    """
    if num_samples is None and part is None:
        return None
    subset = {}
    for name in sorted(doc_counts):
        count = doc_counts[name]
        # Seeded per task, so a task's subset does not depend on the other tasks run.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if part is None:
            picked = rng.choice(count, size=min(num_samples, count), replace=False)
        else:
            index, parts = part
            share = np.array_split(rng.permutation(count), parts)[index - 1]
            picked = share if num_samples is None else share[:num_samples]
        subset[name] = sorted(int(i) for i in picked)
    return subset


def seed_as_lm_eval() -> None:
    """Seed Python's, numpy's and torch's generators as ``simple_evaluate`` does by
    default (lm-eval's ``defaults``), before each evaluation and before tasks load (a
    task's ``process_docs`` may shuffle with ``random``): sampled generation
    (``--gen-kwargs do_sample=true``) then draws alike in every measurement of a mask and
    in lm-eval's own results files, and the tasks hold the documents lm-eval builds."""
    import random

    import torch

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)


def configure_tasks(tasks: Mapping[str, Any], num_fewshot: int | None = None,
                    gen_kwargs: Mapping[str, Any] | None = None) -> None:
    """Put lm-eval's command-line overrides on loaded ``tasks`` (leaf name -> task) as
    ``simple_evaluate`` puts them: ``gen_kwargs`` update each generation task's
    ``generation_kwargs``; ``num_fewshot`` replaces each task's few-shot count except where
    its YAML fixes it at 0; a task that sets none gets 0."""
    for task in tasks.values():
        if gen_kwargs and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value=dict(gen_kwargs), update=True)
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
