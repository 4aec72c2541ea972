"""``hf-headablate``: lm-eval's ``hf`` model with chosen attention heads (and MLP neurons)
knocked out.

    lm_eval --model hf-headablate --model_args pretrained=...,ablate=L0H29+L1H31+L3N1234

Takes every ``hf`` model argument (``dtype``, ``device``, ``peft``, ``gguf_file`` …) plus
``ablate=COMPONENTS`` (heads ``L0H29``, MLP neurons ``L3N1234``, whole layers ``L3H*`` /
``L3N*``), ``ablate_file=PATH`` with optional ``ablate_top=K``, and ``attn_out=PATTERN`` /
``mlp_out=PATTERN`` for architectures whose attention / MLP output projection cannot be
discovered. Names are checked against the model's config before its weights load.
What the knocked-out heads become (``ablation.py``): ``ablation=zero|mean|resample``
(default zero), ``scale=FLOAT`` (default 0; 1 leaves the heads as they are, 2 amplifies),
and for ``mean``/``resample`` the reference set ``ablation_data=FILE|TASK``
(``ablation_field=`` for JSONL, ``ablation_include_path=DIR`` for a task in the CLI's
``--include_path``, which lm-eval does not pass to models); mean's statistics are cached
under ``ablation_cache=DIR``, resample's donors are drawn with ``resample_seed=``.

The heads are a value (``intervention``) applied around each forward pass the harness
asks for (``forward_pass``); between passes the model is as loaded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from lm_eval_headloc.common.checks import (
    UsageError,
    check_batch_size,
    check_dtype,
    check_load_args,
    check_number,
    check_pretrained_given,
)
from lm_eval_headloc.intervention.ablation import (
    FLOAT32_OVERFLOW,
    AblationError,
    Resampler,
    cached_head_means,
    check_ablation,
    check_reference_set,
    check_scale,
    head_means,
    means_folder,
    reference_texts,
    scale_overflow,
)
from lm_eval_headloc.intervention.arg_string import ModelArgs, as_written
from lm_eval_headloc.intervention.components import (
    Component,
    ComponentSpecError,
    check_component_names,
    format_heads,
    names_neurons,
    parse_components,
)
from lm_eval_headloc.intervention.embedded import local_pretrained
from lm_eval_headloc.intervention.geometry import Geometry
from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads
from lm_eval_headloc.intervention.hooks import ActivePass, ComponentKnockout, Intervention
from lm_eval_headloc.intervention.leaving_rows import generate_leaving_rows
from lm_eval_headloc.intervention.model_args import (
    check_device,
    check_ranked_geometry,
    other_knockout,
    requested_components,
)
from lm_eval_headloc.intervention.prompt_start import (
    beams,
    cache_argument,
    laid_out,
    plain_cache,
    shared_start,
)
from lm_eval_headloc.intervention.registration import MODEL_NAME, lm_eval_cli_model_args

__all__ = ["HFHeadAblateLM", "check_against_config"]

# A child of lm-eval's logger, so the `lm_eval` command shows it as it shows its own models'.
log = logging.getLogger("lm_eval.models.hf_headablate")

# No sys.excepthook here: importing the model must not change how a program reports its
# errors. The stock `lm_eval` command's one-line head errors come from registration.py.


@register_model(MODEL_NAME)
class HFHeadAblateLM(HFLM):
    """An ``HFLM`` whose attention heads and MLP neurons can be knocked out, switchable on
    the live object."""

    #: Whether ``generate`` calls compute their prompts' common start once per mask
    #: (``prompt_start``); off for a model whose key/value cache cannot be copied by rows.
    shares_prompt_start = True
    #: Whether greedy rows that finished leave a ``generate`` call's batch on a CPU
    #: (``leaving_rows``); on a GPU a step costs about as much for fewer rows.
    finished_rows_leave = True
    #: The ``RowStops`` made inside ``multigen.rows_stop_on_their_own``, one per ``generate``
    #: call (None outside it: lm-eval's own stopping criteria).
    row_stops: list | None = None

    def __init__(
        self,
        pretrained: Any = None,
        ablate: str | Iterable[str | Component | tuple[int, int]] | None = None,
        ablate_file: str | os.PathLike | None = None,
        ablate_top: int | None = None,
        attn_out: str | None = None,
        mlp_out: str | None = None,
        ablation: str = "zero",
        scale: float = 0.0,
        ablation_data: str | os.PathLike | None = None,
        ablation_field: str | None = None,
        ablation_include_path: str | os.PathLike | None = None,
        ablation_cache: str | os.PathLike | None = None,
        resample_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_pretrained_given(pretrained)  # before any file is read for nothing
        # Read and parse the head list and the reference set before loading weights, so
        # a missing file or a malformed name fails fast; the layer/head ranges are
        # checked once the model is loaded.
        requested = requested_components(ablate, ablate_file, ablate_top)
        for name, pattern, example in (("attn_out", attn_out, "model.layers.*.self_attn.o_proj"),
                                       ("mlp_out", mlp_out, "model.layers.*.mlp.down_proj")):
            # An empty one ('attn_out=') was taken as none: found automatically, unasked.
            if pattern is not None and (not isinstance(pattern, str) or not pattern.strip()):
                raise ComponentSpecError(f"{name}={pattern!r}: expected a module-name pattern, "
                                         f"e.g. {name}={example}, or leave it out (found "
                                         "automatically)")
        self._requested = requested  # checked against the config before the weights load
        self._ablate_file = ablate_file  # its model's geometry too, where it records one
        resample_seed = as_written(resample_seed)
        if resample_seed is not None and (isinstance(resample_seed, bool) or not isinstance(
                resample_seed, int) or resample_seed < 0):
            raise AblationError(f"resample_seed={resample_seed!r}: must be a whole number "
                                ">= 0")
        self.ablation, self.scale = check_ablation(ablation), check_scale(scale)
        if ablate_file is not None:
            differs = other_knockout(ablate_file, self.ablation, self.scale)
            if differs:
                log.warning(differs)
        # Settings another kind would take and ignore: a silent no-op is refused instead.
        if resample_seed is not None and self.ablation != "resample":
            raise AblationError(f"resample_seed={resample_seed}: only ablation=resample draws "
                                f"donors; ablation={self.ablation} takes no seed")
        if ablation_cache is not None and self.ablation != "mean":
            raise AblationError(f"ablation_cache={str(ablation_cache)!r}: only ablation=mean "
                                f"caches statistics; ablation={self.ablation} keeps none")
        if ablation_cache is not None:  # a file of that name: refused before the load
            means_folder(ablation_cache)
        texts = _reference_set(self.ablation, ablation_data, ablation_field,
                               ablation_include_path)
        # The embedded model's name (a run's record) is the folder it lies in here.
        named, pretrained = pretrained, local_pretrained(pretrained)
        check_load_args(pretrained, kwargs.get("dtype"), kwargs.get("peft"),
                        kwargs.get("gguf_file"), kwargs.get("tokenizer"), kwargs.get("delta"),
                        kwargs.get("subfolder"))
        for name in ("softmax_dtype", "mixed_precision_dtype"):  # read after the load
            check_dtype(kwargs.get(name), name)
        if kwargs.get("max_length") is not None:  # HFLM takes 0 as unset, asserts on -1
            kwargs["max_length"] = check_number(as_written(kwargs["max_length"]),
                                                "max_length", whole=True, min_val=1)
        for name in ("batch_size", "max_batch_size"):  # lm-eval's: a bare assert, or none
            if kwargs.get(name) is not None:
                kwargs[name] = check_batch_size(kwargs[name], f"{name}=")
                if name == "max_batch_size" and isinstance(kwargs[name], str):
                    raise UsageError(f"max_batch_size={kwargs[name]}: must be a whole number "
                                     ">= 1")
        if not kwargs.get("parallelize"):
            check_device(kwargs.get("device"))
        # ablate=L0H1,L1H2: L1H2 would be an unknown argument, and "leave it out" drop it.
        stray = next((name for name in kwargs if _is_component_name(name)), None)
        if stray is not None:
            raise ComponentSpecError(f"model_args {stray}: a head (or neuron) given as an "
                                     "argument of its own; ',' separates model_args, '+' "
                                     "joins the heads of one (ablate=L0H29+L1H31)")
        # HFLM sets its mixed_precision_dtype only after the load: _create_model reads it here.
        self._mixed_precision = kwargs.get("mixed_precision_dtype")
        try:
            with cached_gguf_reads():  # config, tokenizer and weights: one parse of a GGUF
                super().__init__(pretrained=pretrained, **kwargs)
        except TypeError as err:  # HFLM passes what it does not know on to the model
            unknown = re.search(r"unexpected keyword argument '([^']+)'", str(err))
            if unknown is None or unknown[1] not in kwargs:
                raise
            raise UsageError(f"model_args {unknown[1]}={kwargs[unknown[1]]!r}: neither "
                             "lm-eval's HFLM nor the model takes it; leave it out or check "
                             "its spelling") from None
        # A model passed in and wrapped again (a notebook's loop) keeps one set of hooks.
        self.knockout, hooked_here = ComponentKnockout.on(self.model, attn_out, mlp_out)
        # What the model's passes knock out: a value, applied around each forward pass
        # (``forward_pass``); ``knocking_out`` stands in another one for a while.
        self._means: dict[str, tuple] | None = None  # mean ablation's, per kind and layer
        self._reference_tokens: list[list[int]] | None = None
        self._means_dir: str | os.PathLike | None = None
        self._standing = Intervention(scale=self.scale)
        self._override: Intervention | None = None
        self._said_plain = False  # forward_pass's warning, once
        self.ablation_data: str | None = None  # set_ablation's source and field
        self.ablation_field: str | None = None
        self.ablation_include_path: str | None = None
        self.resample_seed = 0 if resample_seed is None else resample_seed
        self.means_file: str | None = None
        self.neuron_means_file: str | None = None
        self.reference_digest: str | None = None
        self.reference_examples: list[str] | None = None  # set_ablation's texts
        self.resampler: Resampler | None = None
        self._prompt_lengths: dict[tuple[int, ...], int] = {}  # model input -> prompt tokens
        # Model input -> the reference tokens of every document it is the input of.
        self._documents: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        # What cached means are keyed by besides their tokens.
        self._means_key = {
            "model": named if isinstance(named, (str, os.PathLike))
            else getattr(self.model.config, "_name_or_path", type(self.model).__name__),
            **{name: kwargs.get(name) for name in ("gguf_file", "revision", "peft", "delta")},
            "dtype": str(self.model.dtype), "attn_out": attn_out,
        }
        self._mlp_out = mlp_out
        self._cache_db = None
        try:
            if texts is not None:
                self.set_ablation(self.ablation, texts, ablation_cache, ablation_data,
                                  ablation_field, ablation_include_path)
            self.set_heads(requested)
        except BaseException:
            # A model passed in (pretrained=<model>) is the caller's: a constructor that
            # fails here (a head past the model, a reference set too small) leaves it
            # without hooks (those an earlier wrapper of it uses stay).
            if hooked_here:
                self.knockout.remove()
            raise

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None
                               ) -> HFHeadAblateLM:
        parsed = ModelArgs.parse(arg_string)
        _refuse_given_twice(parsed)
        return cls.create_from_arg_obj(dict(parsed.args), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None
                            ) -> HFHeadAblateLM:
        """As lm-eval's, but a model argument written in ``--model_args`` wins over the
        one lm_eval's command line passes beside it (``device``, whose default there is
        cuda:0, ``batch_size``, ``max_batch_size``), where lm-eval's ``hf`` stops with
        "got multiple values for keyword argument"."""
        # The stock `lm_eval` command hands over a dict, a name given twice already dropped.
        command_line = lm_eval_cli_model_args()
        if command_line:
            _refuse_given_twice(ModelArgs.parse(command_line))
        extra = {key: value for key, value in (additional_config or {}).items()
                 if value is not None and key not in arg_dict}
        return cls(**arg_dict, **extra)

    def _create_model(self, *args: Any, **kwargs: Any) -> None:
        # HFLM reads the config first: the requested components are checked against it
        # here, before the weights load (a neuron past the MLP's width fails in seconds).
        _check_backend(getattr(self, "backend", None), self._config)
        check_against_config(self._requested, self._config)
        # A scale past the model's arithmetic made every knocked-out logit NaN, which
        # lm-eval then scored as answers (acc 0.75 against 0.25): refused before the load.
        runs_in = scale_overflow(self.scale, kwargs.get("dtype"), self._config,
                                 self._mixed_precision)
        if runs_in is not None:
            raise AblationError(f"scale={self.scale:g}: beyond float32's range (from "
                                f"{FLOAT32_OVERFLOW:.7g} on, a float32 is inf); in the "
                                f"model's {runs_in} arithmetic every knocked-out output "
                                "would be inf and every score NaN: give a smaller scale= (or "
                                "dtype=float64)")
        if self._ablate_file is not None:
            try:
                per_layer = Geometry.from_config(self._config).heads_per_layer
            except AttributeError:
                per_layer = None  # no head counts in the config: nothing to compare
            check_ranked_geometry(self._ablate_file, per_layer)
        super()._create_model(*args, **kwargs)

    def set_ablation(self, kind: str, texts: list[str] | None = None,
                     cache_dir: str | os.PathLike | None = None,
                     source: str | os.PathLike | None = None,
                     field: str | None = None,
                     include_path: str | os.PathLike | None = None) -> None:
        """Switch the ablation kind on the live model (``ablation.py``). Mean and resample
        need the reference examples ``texts``: for mean their per-head means (from the
        cache under ``cache_dir``, or one pass over them), for resample the donors.
        ``source``/``field``/``include_path``: the ``ablation_data=``/``ablation_field=``/
        ``ablation_include_path=`` the texts were read from, as the model's arguments say
        it (None: texts handed over, e.g. a run's own examples)."""
        kind = check_ablation(kind)
        if (kind == "zero") != (texts is None):
            raise AblationError(f"ablation={kind}: " + ("uses no reference set" if kind == "zero"
                                                        else "needs reference texts"))
        if isinstance(texts, (str, bytes)):  # its characters would be the examples
            raise AblationError(f"ablation={kind}: texts is one string; give a list of "
                                "reference examples")
        if texts is not None:  # checked before anything changes: a refusal leaves it as it was
            texts = list(texts)
            check_reference_set(kind, texts)
            if kind == "resample" and getattr(self, "backend", "causal") != "causal":
                raise AblationError("ablation=resample needs a decoder-only model (its donors "
                                    "are aligned by position in one sequence); use mean")
            if kind == "resample" and _prepends_virtual_tokens(self.model):
                raise AblationError("ablation=resample: this PEFT adapter (prompt tuning, "
                                    "P-tuning) puts virtual tokens before each input, which "
                                    "the donors' positions do not allow for; use mean")
        saved = {name: getattr(self, name) for name in self._ABLATION_STATE
                 if hasattr(self, name)}
        try:
            self._switch_ablation(kind, texts, cache_dir, source, field, include_path)
        except BaseException:  # a failed means pass (or Ctrl-C) leaves the old ablation
            for name, value in saved.items():
                setattr(self, name, value)
            raise

    #: What ``set_ablation`` changes (and puts back when the switch fails).
    _ABLATION_STATE = ("ablation_data", "ablation_field", "ablation_include_path", "_means",
                       "ablation", "resampler", "means_file", "neuron_means_file",
                       "reference_digest", "_standing", "_reference_tokens", "_means_dir",
                       "reference_examples")

    def _switch_ablation(self, kind: str, texts: list[str] | None,
                         cache_dir: str | os.PathLike | None,
                         source: str | os.PathLike | None, field: str | None,
                         include_path: str | os.PathLike | None = None) -> None:
        self.ablation_data = None if source is None else str(source)
        self.ablation_field = field
        self.ablation_include_path = None if include_path is None else str(include_path)
        self._means = None
        self.ablation, self.resampler, self.means_file = kind, None, None
        self.neuron_means_file = None
        self.reference_digest = None
        self.reference_examples = texts
        self._standing = self._intervention(self._standing.components)
        if texts is None:
            return
        tokens = [self.tok_encode(text)[-self.max_length:] for text in texts]
        self.reference_digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
        if self.ablation == "resample":
            self.resampler = Resampler(tokens, seed=self.resample_seed)
            return
        self._reference_tokens, self._means_dir, self._means = tokens, cache_dir, {}
        self._ensure_means(self._standing.kinds | {"heads"})
        self._standing = self._intervention(self._standing.components)

    def _ensure_means(self, kinds: Iterable[str]) -> None:
        """Mean ablation's per-layer means for each of ``kinds`` (``"heads"``,
        ``"neurons"``) not computed yet: from the cache, or one pass over the reference
        set. Neurons' means are computed the first time a neuron is knocked out."""
        if self._means is None:
            return
        knockout = self.knockout
        for kind in sorted(set(kinds) - set(self._means)):
            # The heads' key is the one cached means always had (old caches stay valid).
            site = {} if kind == "heads" else {"site": kind, "mlp_out": self._mlp_out}
            fields = {**self._means_key, **site, "weights": _weights_fingerprint(self.model),
                      "tokens": self.reference_digest}
            modules = knockout.site_modules([kind])
            units = knockout.heads_per_layer if kind == "heads" else knockout.neurons_per_layer

            def compute(modules: list = modules, units: int = units) -> list:
                with knockout.applied(None):  # the unablated model's means
                    return head_means(self.model, modules, units, self._reference_tokens)

            means, path = cached_head_means(fields, compute, self._means_dir)
            self._means[kind] = knockout.check_replacement(means, kind)
            if kind == "heads":
                self.means_file = str(Path(path).resolve())
            else:
                self.neuron_means_file = str(Path(path).resolve())

    def _intervention(self, components: Iterable[Component] = (), row_masks: Any = None
                      ) -> Intervention:
        """``components`` (or per-row masks) knocked out the way this model ablates."""
        intervention = Intervention(components=tuple(components), row_masks=row_masks,
                                    scale=self.scale)
        if self._means is None:
            return intervention
        kinds = self.knockout.kinds_of(intervention)
        self._ensure_means(kinds)
        return intervention.replace(replacement={k: self._means[k] for k in kinds})

    @property
    def intervention(self) -> Intervention:
        """What the model's forward passes knock out now."""
        return self._override if self._override is not None else self._standing

    @contextlib.contextmanager
    def knocking_out(self, heads: str | Iterable[str | Component | tuple[int, int]] = (), *,
                     row_masks: Any = None) -> Iterator[Intervention]:
        """Inside, the model answers with ``heads`` (heads and neurons) knocked out (or,
        with ``row_masks`` ((rows, components) booleans over the flat index, see
        ``hooks.Intervention``), a different mask in each batch row) instead of its own
        ``set_heads``; on exit, as before, whatever happened inside."""
        if row_masks is not None and (heads if isinstance(heads, str) else list(heads)):
            # The row masks say every row's components: heads beside them were dropped.
            raise ComponentSpecError(f"knocking_out({heads!r}, row_masks=...): give the "
                                     "components either as names or as row masks, not both")
        parsed = () if row_masks is not None else self._parsed(heads)
        saved, self._override = self._override, self._intervention(parsed, row_masks)
        # Per-row masks are forward passes of our own (multimask, once per batch), never
        # answers lm-eval caches: the response cache's table stays as it is.
        cached = row_masks is None
        if cached:
            self._select_cache_table()
        try:
            yield self._override
        finally:
            self._override = saved
            if cached:
                self._select_cache_table()

    @contextlib.contextmanager
    def forward_pass(self, input_ids: Any, attention_mask: Any = None,
                     columns: int | None = None, *, always_donors: bool = False
                     ) -> Iterator[ActivePass | None]:
        """Inside, the model's forward passes over ``input_ids`` run under
        ``intervention``: the one place a pass is intervened on (lm-eval's requests go
        through ``_model_call`` and ``_model_generate``, which use it). Resample ablation's
        donors are computed here for ``input_ids`` (right-padded with zeros, or
        left-padded as ``attention_mask`` says) when a head is knocked out, or
        ``always_donors``. Nothing stays applied after it."""
        intervention = self.intervention
        if self._override is None and not self._said_plain and not intervention.components \
                and (self.ablation, self.scale) != ("zero", 0.0):
            # ablation=/scale= asked for a knockout, no head was named: the passes are the
            # plain model's, which a results file would otherwise pass off as a knockout's.
            self._said_plain = True
            log.warning("ablation=%s,scale=%g with no heads or neurons named (ablate=, "
                        "ablate_file=): nothing is knocked out; these are the plain "
                        "model's answers", self.ablation, self.scale)
        donors = None
        if self.resampler is not None and (always_donors or intervention.any_knocked_out):
            donors = self._donors(input_ids, attention_mask, columns,
                                  self.knockout.kinds_of(intervention))
        with self.knockout.applied(intervention, donors) as active:
            yield active

    def _donors(self, input_ids: Any, attention_mask: Any, columns: int | None,
                kinds: list[str]) -> tuple:
        ids = input_ids.tolist()
        own = None  # generation: the prompt is the row and its document
        if attention_mask is not None:  # generation: left padding; the prompt is the row
            starts = [len(row) - int(sum(mask)) for row, mask in
                      zip(ids, attention_mask.tolist(), strict=True)]
            rows = [row[start:] for row, start in zip(ids, starts, strict=True)]
        else:  # loglikelihood batches: right padding
            starts = [0] * len(ids)
            inputs = [self._model_input(row) for row in ids]  # once a row: a hot path
            rows = [self._prompt_of(key) for key in inputs]
            own = [self._documents.get(key) or {tuple(prompt)}
                   for key, prompt in zip(inputs, rows, strict=True)]
        knockout = self.knockout
        with knockout.applied(None):  # the donors' own clean pass
            return self.resampler.donors(
                self.model, knockout.site_modules(kinds), rows, starts,
                columns if columns is not None else input_ids.shape[1], own)

    def _model_input(self, row: list[int]) -> tuple[int, ...]:
        """A loglikelihood batch row without its right padding: one of the model inputs
        ``remember_prompts`` saw, possibly followed by padding, so the longest remembered
        prefix is the row (token id 0 is a real token in some vocabularies, e.g. GPT-2's
        ``!``, so trailing zeros cannot tell); else the row without its trailing zeros."""
        last = max((i + 1 for i, t in enumerate(row) if t != 0), default=1)
        for end in range(len(row), last - 1, -1):  # only the trailing zeros are in doubt
            if tuple(row[:end]) in self._prompt_lengths:
                return tuple(row[:end])
        return tuple(row[:last])

    def _unpadded(self, row: list[int]) -> list[int]:
        """A loglikelihood batch row without its right padding (``_model_input``), up to
        its prompt's end. The donor follows the prompt, not the answer scored after it, so
        every choice of a multiple-choice question gets the same donor."""
        return self._prompt_of(self._model_input(row))

    def _prompt_of(self, key: tuple[int, ...]) -> list[int]:
        """A model input's (``_model_input``) prompt: up to its remembered prompt's end."""
        return list(key[:self._prompt_lengths.get(key, len(key))])
    def remember_prompts(self, encoded: Iterable[tuple[list[int], list[int]]],
                         whole: bool = False) -> None:
        """Note where the prompt ends in the model input of each (context, continuation)
        token pair, built as HFLM builds it (resample picks donors by the prompt);
        ``whole``: the whole input is the prompt (a perplexity task's window)."""
        from lm_eval_headloc.intervention.multimask import model_input

        for context, continuation in encoded:
            row = tuple(model_input(context, continuation, self.max_length))
            prompt = len(row) if whole else max(1, len(row) - len(continuation) + 1)
            # Requests of several documents can share one model input, split elsewhere
            # ("the cat" + " sat on", "the cat sat" + " on"); HFLM and multimask answer them
            # from one row, so one donor, that none of them may be. The shortest prompt
            # picks it, whatever order the requests come in.
            earlier = self._prompt_lengths.get(row)
            self._prompt_lengths[row] = prompt if earlier is None else min(prompt, earlier)
            if whole:  # a window's document is its whole text: loglikelihood_rolling
                continue
            document = tuple(context[-self.max_length:])
            documents = self._documents.get(row)
            if documents is None and document == row[:prompt] and earlier in (None, prompt):
                # The row's prompt is its one document, what ``_donors`` takes where none
                # is kept: a copy of every request's context would double what is kept.
                continue
            if documents is None:  # the row's first request's was its prompt
                documents = self._documents[row] = (set() if earlier is None
                                                    else {row[:earlier]})
            documents.add(document)

    @contextlib.contextmanager
    def _requests_of_one_call(self) -> Iterator[None]:
        """Inside, the model inputs and documents resample knows are those of one call of
        lm-eval's (``loglikelihood``, ``loglikelihood_rolling``): the rows it answers. An
        earlier call's (another task evaluated before on this object) would move a shared
        input's prompt, and so its donor: a task's scores would depend on what the object
        evaluated before. Those remembered outside (``remember_prompts``) are back after."""
        saved = self._prompt_lengths, self._documents
        self._prompt_lengths, self._documents = {}, {}
        try:
            yield
        finally:
            self._prompt_lengths, self._documents = saved

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        with self._requests_of_one_call():
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        with self._requests_of_one_call():
            return self._loglikelihood_rolling(requests, disable_tqdm)

    def _loglikelihood_rolling(self, requests: list, disable_tqdm: bool) -> list:
        if self.resampler is not None:
            # Each window's document is the whole text it is cut from (as the reference
            # set tokenizes it), which no window alone holds: noted per window's input.
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            from lm_eval_headloc.intervention.multimask import model_input

            for (text,) in (request.args for request in requests):
                tokens = self.tok_encode(text)
                document = tuple(tokens[-self.max_length:])
                # The windows HFLM's loglikelihood_rolling cuts, as it cuts them.
                for window in get_rolling_token_windows(tokens, self.prefix_token_id,
                                                        self.max_length, context_len=1):
                    row = tuple(model_input(*make_disjoint_window(window), self.max_length))
                    self._documents.setdefault(row, set()).add(document)
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests: list, *args: Any, **kwargs: Any) -> list:
        # A rolling window (loglikelihood_rolling's, keyed None) scores a whole text after a
        # one-token context (the prefix token): by that context every document of a
        # perplexity task got one and the same donor; the window's own tokens pick it.
        for rolling in (False, True):
            self.remember_prompts(((context, continuation) for key, context, continuation
                                   in requests if (key is None) == rolling), whole=rolling)
        return super()._loglikelihood_tokens(requests, *args, **kwargs)

    def _model_call(self, inps: Any, attn_mask: Any = None, labels: Any = None) -> Any:
        with self.forward_pass(inps):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, context: Any, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> Any:
        from lm_eval_headloc.intervention.multigen import rows_stop_on_their_own, stops_per_row

        width = max(int(max_length), int(context.shape[1]))
        # Greedy rows end on their own (multigen.RowStops): the same text, shorter batches.
        stopping = (rows_stop_on_their_own(self) if stops_per_row(self, generation_kwargs)
                    else contextlib.nullcontext())
        with self.forward_pass(context, generation_kwargs.get("attention_mask"),
                               width) as active, stopping:
            if active is None or active.donors is None:
                return self._generate_after_shared_start(context, max_length, stop,
                                                         generation_kwargs)
            # Beam search runs each row's beams as rows after it: each gets the row's donor.
            active.donor_index = active.donor_index.repeat_interleave(
                beams(self.model, generation_kwargs), dim=0)
            seen = [0]

            def track_columns(_module: Any, args: tuple, kwargs: dict) -> None:
                # With the key/value cache each step sees only its new columns: say where
                # they start, so each gets its aligned donor position.
                ids = kwargs.get("input_ids", args[0] if args else None)
                position = kwargs.get("cache_position")
                active.first_column = int(position[0]) if position is not None else seen[0]
                seen[0] = active.first_column + (ids.shape[1] if ids is not None else 1)

            handle = self.model.register_forward_pre_hook(track_columns, with_kwargs=True)
            try:
                return self._generate(context, max_length, stop, generation_kwargs)
            finally:
                handle.remove()

    def _generate(self, context: Any, max_length: int, stop: list[str],
                  generation_kwargs: dict[str, Any]) -> Any:
        """HFLM's ``_model_generate``; inside ``multigen.rows_stop_on_their_own`` the same
        greedy call (``stops_per_row`` held) with each row ending on its own."""
        from transformers import StoppingCriteriaList

        from lm_eval_headloc.intervention.multigen import row_stops_for, stopping_per_row

        if not stopping_per_row(self):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        stops = row_stops_for(self, stop, context.shape[1], context.shape[0])
        return self._greedy_generate(context, max_length, StoppingCriteriaList([stops]),
                                     generation_kwargs)

    def _greedy_generate(self, ids: Any, max_length: int, criteria: Any,
                         generation_kwargs: dict[str, Any]) -> Any:
        """The model's ``generate`` as HFLM's ``_model_generate`` calls it for a greedy
        request (``do_sample=False``, no temperature), stopped by ``criteria`` (a
        ``StoppingCriteriaList``)."""
        options = {key: value for key, value in generation_kwargs.items()
                   if key not in ("temperature", "do_sample")}
        with self._autocast():
            return self.model.generate(
                input_ids=ids, max_length=max_length, stopping_criteria=criteria,
                pad_token_id=self.tokenizer.pad_token_id, use_cache=True, do_sample=False,
                **options)

    def _generate_after_shared_start(self, context: Any, max_length: int, stop: list[str],
                                     generation_kwargs: dict[str, Any]) -> Any:
        """HFLM's ``_model_generate`` with the prompts' common start computed once per
        distinct mask (``prompt_start``): the same tokens, in every column. Resample
        ablation's donors, aligned to the left-padded columns, never come here."""
        import torch

        from lm_eval_headloc.intervention.multigen import stopping_per_row

        attention = generation_kwargs.get("attention_mask")
        start = shared_start(context, attention) if self.shares_prompt_start else 0
        name = cache_argument(self.model) if start else None
        intervention = self.intervention
        if intervention.row_masks is None:
            distinct, which = None, torch.zeros(len(context), dtype=torch.long)
        else:
            distinct, which = torch.unique(torch.as_tensor(intervention.row_masks), dim=0,
                                           return_inverse=True)
        copies = 1 if distinct is None else len(distinct)
        # Beam search repeats each row, its cache too: one made for the rows would not fit.
        if name is None or name in generation_kwargs or copies >= len(context) \
                or beams(self.model, generation_kwargs) > 1:
            return self._generate(context, max_length, stop, generation_kwargs)
        ids, mask = laid_out(context, attention, start)
        once = intervention if distinct is None else intervention.replace(row_masks=distinct)
        with torch.no_grad(), self.knockout.applied(once), self._autocast():
            cache = getattr(self.model(input_ids=ids[:1, :start].expand(copies, -1),
                                       use_cache=True), name)
        if not plain_cache(cache):
            self.shares_prompt_start = False  # the same for every later call
            return self._generate(context, max_length, stop, generation_kwargs)
        cache.batch_select_indices(which.to(ids.device))
        if self.finished_rows_leave and self.device.type == "cpu" and stopping_per_row(self):
            generated = self._generate_leaving_rows(ids, mask, cache, name, max_length, stop,
                                                    generation_kwargs)
        else:
            generated = self._generate(ids, max_length, stop,
                                       {**generation_kwargs, "attention_mask": mask, name: cache})
        generated[:, :context.shape[1]] = context  # the prompt columns as they came
        return generated

    def _autocast(self) -> Any:
        """HFLM's mixed precision for the model's own calls (``mixed_precision_dtype``)."""
        import torch

        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

    def _generate_leaving_rows(self, ids: Any, mask: Any, cache: Any, name: str,
                               max_length: int, stop: list[str],
                               generation_kwargs: dict[str, Any]) -> Any:
        """HFLM's greedy ``_model_generate`` of ``ids`` from ``cache``, its rows leaving
        the batch as they finish (``leaving_rows``), inside ``multigen.
        rows_stop_on_their_own``."""
        import torch

        from lm_eval_headloc.intervention.multigen import row_stops_for

        stops = row_stops_for(self, stop, ids.shape[1], ids.shape[0])
        options = {key: value for key, value in generation_kwargs.items()
                   if key != "attention_mask"}
        row_masks = self.intervention.row_masks

        def rows_of(rows: Any) -> Any:
            if row_masks is None:
                return contextlib.nullcontext()
            return self.knockout.applied(self.intervention.replace(
                row_masks=torch.as_tensor(row_masks)[rows.cpu()]))

        def generate(inputs: Any, attention_mask: Any, criteria: Any) -> Any:
            return self._greedy_generate(
                inputs, max_length, criteria,
                {**options, "attention_mask": attention_mask, name: cache})

        return generate_leaving_rows(generate, ids, mask, cache, stops,
                                     self.tokenizer.pad_token_id, max_length, rows_of)

    @property
    def num_layers(self) -> int:
        return self.knockout.num_layers

    @property
    def heads_per_layer(self) -> int:
        return self.knockout.heads_per_layer

    @property
    def knocked_out(self) -> tuple[Component, ...]:
        """The heads and neurons the model's answers knock out now."""
        return self.intervention.components

    @property
    def neurons_per_layer(self) -> int:
        """The MLP's width (finding the MLP output projections on first use)."""
        return self.knockout.neurons_per_layer

    def _parsed(self, components: str | Iterable[str | Component | tuple[int, int]]
                ) -> tuple[Component, ...]:
        if isinstance(components, str) and not components.strip():
            return ()
        if not isinstance(components, (str, Iterable)):  # set_heads(5): not iterable
            raise ComponentSpecError(f"{components!r}: give heads like 'L0H29+L1H31' or a "
                                     "list of names, Heads, Neurons or (layer, head) pairs")
        width = self.neurons_per_layer if names_neurons(components) else None
        return tuple(parse_components(components, self.num_layers, self.heads_per_layer,
                                      width, head_layers=self.knockout.geometry.head_layers))

    def set_heads(self, heads: str | Iterable[str | Component | tuple[int, int]]
                  ) -> tuple[Component, ...]:
        """Knock out exactly these heads and neurons in every answer from now on (``[]``
        for none): a value swapped in place, cheap. ``knocking_out`` does it for a while."""
        self._standing = self._intervention(self._parsed(heads))
        self._select_cache_table()
        return self._standing.components

    # --- lm-eval's response cache (--use_cache) -----------------------------------
    # lm-eval keys cached responses by the request alone. Each mask therefore gets its
    # own table in the cache file, so a cached answer computed under another mask can
    # never be returned. With no heads knocked out the model *is* plain `hf`, so it
    # shares the default table with `hf` runs on the same cache file.

    def set_cache_hook(self, cache_hook: Any) -> None:
        super().set_cache_hook(cache_hook)
        self._cache_db = getattr(cache_hook, "dbdict", None)
        self._select_cache_table()

    def cache_table(self) -> str:
        """Name of the response-cache table for the current mask."""
        if not self.knocked_out:
            return "unnamed"  # sqlitedict's default table, the one plain `hf` uses
        # The kind and scale change the answers too (zero at scale 0: the old key).
        key = format_heads(self.knocked_out)
        if (self.ablation, self.scale) != ("zero", 0.0):
            key += (f"|{self.ablation}|{self.scale!r}|{self.means_file}|"
                    f"{self.reference_digest}|{self.resample_seed}")
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        return f"headablate-{digest}"

    def _select_cache_table(self) -> None:
        db = self._cache_db
        if db is None:
            return
        table = self.cache_table()
        if db.tablename != table:
            db.commit()
            db.tablename = table
            db.conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)'
            )
            db.conn.commit()

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["ablate"] = format_heads(self.knocked_out)
        info.update(ablation=self.ablation, scale=self.scale, ablation_data=self.ablation_data,
                    means_file=self.means_file, reference_digest=self.reference_digest)
        if self.ablation_field is not None:  # which texts of ablation_data= were the set
            info["ablation_field"] = self.ablation_field
        if self.ablation_include_path is not None:  # where ablation_data='s task was found
            info["ablation_include_path"] = self.ablation_include_path
        # The projections named by hand: a rerun finding others would knock out others.
        for name in ("attn_out", "mlp_out"):
            if getattr(self.knockout, name) is not None:
                info[name] = getattr(self.knockout, name)
        if self.neuron_means_file is not None:
            info["neuron_means_file"] = self.neuron_means_file
        if self.ablation == "resample":
            info["resample_seed"] = self.resample_seed
        return info


def _refuse_given_twice(parsed: ModelArgs) -> None:
    """A model argument given twice is refused: lm-eval keeps the last, so
    ``ablate=L0H1,ablate=L1H2`` would knock out L1H2 alone."""
    twice = parsed.given_twice()
    if twice is not None:
        joined = " (its heads joined by '+': ablate=L0H29+L1H31)" if twice == "ablate" else ""
        raise UsageError(f"model_args {twice}= is given twice ({parsed.text}); lm-eval "
                         f"keeps the last: give it once{joined}")


def _is_component_name(name: str) -> bool:
    """Whether ``name`` (an argument's name) is a head or neuron name (``L1H2``, ``L3N*``)."""
    try:
        check_component_names(name)
    except ComponentSpecError:
        return False
    return True


def _check_backend(backend: str | None, config: Any) -> None:
    """Refuse ``backend=seq2seq`` on a model AutoModelForSeq2SeqLM does not load (a
    decoder-only one), which was transformers' traceback once the config was read."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ,
    )

    model_type = getattr(config, "model_type", None)
    if backend == "seq2seq" and model_type not in SEQ2SEQ:
        raise UsageError(f"backend=seq2seq: {model_type} is not an encoder-decoder model "
                         "(AutoModelForSeq2SeqLM does not load it); leave backend= out or "
                         "give backend=causal")


def check_against_config(names: Iterable[str | Component | tuple[int, int]],
                         config: Any) -> None:
    """Raise ComponentSpecError naming the first component outside the model ``config``
    describes (where the config does not give the MLP's width, neurons are checked once
    the MLP is found)."""
    names = list(names)
    if not names:
        return
    try:
        geometry = Geometry.from_config(config)
    except AttributeError:
        return  # no layer/head counts in the config: checked on the loaded model
    parse_components(names, geometry.num_layers, geometry.heads_per_layer,
                     geometry.neurons_per_layer if names_neurons(names) else None,
                     head_layers=geometry.head_layers)


def _reference_set(ablation: str, data: Any, field: Any, include_path: Any = None
                   ) -> list[str] | None:
    """The reference texts mean ablation needs (None for zero), read before loading.
    ``include_path``: a folder of task YAMLs where ``data`` names a task (the stock CLI's
    ``--include_path`` does not reach the model)."""
    if field is not None and not isinstance(field, str):
        raise AblationError(f"ablation_field={field!r}: expected a JSONL field name")
    if ablation == "zero":
        if data is not None or field is not None or include_path is not None:
            raise AblationError("ablation_data=/ablation_field=/ablation_include_path= are "
                                "for ablation=mean or resample; zero ablation uses no "
                                "reference set")
        return None
    if data is None:
        raise AblationError(f"ablation={ablation} needs a reference set: ablation_data= a "
                            "text file (one example per line), a JSONL file or a task name")
    manager = None
    if include_path is not None:
        from lm_eval_headloc.tasks import UnknownTaskError, make_task_manager

        try:
            manager = make_task_manager(str(include_path), option="ablation_include_path=")
        except UnknownTaskError as err:
            raise AblationError(str(err)) from None
    texts = reference_texts(data, field, task_manager=manager)
    check_reference_set(ablation, texts)
    return texts


def _prepends_virtual_tokens(model: Any) -> bool:
    """Whether ``model`` is a PEFT prompt-learning model whose virtual tokens come before
    the input's (prompt tuning, P-tuning; prefix tuning's are keys and values only)."""
    config = getattr(model, "active_peft_config", None)
    return (bool(getattr(config, "is_prompt_learning", False))
            and getattr(config, "peft_type", None) != "PREFIX_TUNING")  # a str enum


def _weights_fingerprint(model: Any) -> str:
    """A digest of every parameter's name, shape and sum: cached means follow the weights
    (a folder overwritten with other weights gets new means), at one pass over them. Summed
    in float64 without a float64 copy: an 8B model's embedding would take 4 GiB more on a
    GPU it may already fill."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            total = (float(tensor.sum(dtype=torch.float64)) if tensor.device.type != "meta"
                     else 0.0)
            digest.update(f"{name}{tuple(tensor.shape)}{total!r}".encode())
    return digest.hexdigest()
