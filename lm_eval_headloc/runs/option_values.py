"""Option values as text or Python gives them, parsed and checked one at a time: the
numbers-or-words (``--masks auto``), the example part, ``--gen-kwargs``, path lists.

``RunSpec``'s fields name these as their parsers (``runs.spec``), the command line as its
argparse types (``cli.options``): each value has one parser, whichever way it comes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError, check_batch_size, check_number
from lm_eval_headloc.intervention.arg_string import ModelArgs

#: A RunSpec field's role (``RunSpec``'s docstring): what is measured, how it is ranked, or
#: how fast and loudly a run goes.
RESULT, SETTING, RUNTIME = "result", "setting", "runtime"
_SAME = object()  # option's legacy: the same as the default

__all__ = ["ABLATION_FLAGS", "HARNESS_MODEL_ARGS", "MAX_COUNT", "RESULT", "RUNTIME", "SETTING",
           "canonical_gen_kwargs", "check_model_args", "comma_list", "flag_of", "option",
           "parse_batch_size", "parse_candidates", "parse_examples_part", "parse_gen_kwargs",
           "parse_masks", "parse_max_measurements", "parse_sparsity", "path_list",
           "refuse_keywords"]


def flag_of(name: str) -> str:
    """A RunSpec field's command-line flag: ``num_fewshot`` -> ``--num-fewshot``."""
    return "--" + name.replace("_", "-")


#: The most measurements a count option takes (masks, heads alone, group tests, the cap):
#: more than a run makes in a year at a second each, so a larger number is a typo.
MAX_COUNT = 10**7


def comma_list(text: str) -> tuple[str, ...]:
    # A metric's filter also follows a comma (gsm8k:exact_match,strict-match); the engine
    # re-joins such parts once it knows the task names.
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _number_or_word(value: float | str, flag: str, is_word: Any, allowed: str, *,
                    whole: bool, **limits: Any) -> float | str:
    """A number within ``limits`` (``check_number``), or a word ``is_word`` accepts; a
    text that is neither is refused naming ``allowed``."""
    if isinstance(value, str):
        text = value.strip()
        if is_word(text):
            return text
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise UsageError(f"{flag} {value!r}: must be {allowed}") from None
    try:
        return check_number(value, flag, whole=whole, **limits)
    except UsageError:  # out of range: said with the word that is allowed too
        raise UsageError(f"{flag} {value!r}: must be {allowed}") from None


def parse_batch_size(value: int | str) -> int | str:
    """A whole number >= 1, ``auto`` or ``auto:N`` (lm-eval's forms)."""
    return check_batch_size(value, "--batch-size")


def parse_masks(value: int | str) -> int | str:
    """A whole number >= 2 (the fit needs two masks: one is an error after measuring it)
    or ``auto``."""
    return _number_or_word(value, "--masks", lambda t: t == "auto",
                           "a whole number >= 2 or 'auto'", whole=True, min_val=2)


def parse_max_measurements(value: int | str) -> int | str:
    """A whole number >= 1 or ``auto``."""
    return _number_or_word(value, "--max-measurements", lambda t: t == "auto",
                           f"a whole number from 1 to {MAX_COUNT} or 'auto'", whole=True,
                           min_val=1, max_val=MAX_COUNT)


def parse_examples_part(value: str | None) -> tuple[int, int] | None:
    """``K/N`` as (K, N) with 1 <= K <= N, or None."""
    if value is None:
        return None
    parts = str(value).split("/")
    try:
        index, count = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        index, count = 0, 0
    if not 1 <= index <= count:
        raise UsageError(f"--examples-part {value!r}: must be K/N with 1 <= K <= N, e.g. 1/2")
    return index, count


def parse_candidates(value: int | str) -> int | str:
    """A whole number >= 1 or ``auto``."""
    return _number_or_word(value, "--candidates", lambda t: t == "auto",
                           f"a whole number from 1 to {MAX_COUNT} or 'auto'", whole=True,
                           min_val=1, max_val=MAX_COUNT)


def parse_sparsity(value: float | str) -> float | str:
    """A number strictly between 0 and 1, or ``auto``."""
    return _number_or_word(value, "--sparsity", lambda t: t == "auto",
                           "a number strictly between 0 and 1, or 'auto'", whole=False,
                           min_val=0, max_val=1, include_boundaries="neither")


#: generate's numeric arguments that it refuses only once the model is loaded: each key ->
#: (whole number?, lowest, lowest allowed?, highest). Its warpers take only a float for the
#: real-valued ones (``temperature=2`` is a ValueError there) and an int for ``top_k``, so
#: the values are made so here: ``temperature=0`` and ``0.0`` are also one run.
_GENERATE_NUMBERS = {"temperature": (False, 0, True, None), "top_p": (False, 0, True, 1),
                     "top_k": (True, 0, True, None), "min_p": (False, 0, True, 1),
                     "repetition_penalty": (False, 0, False, None)}


def _generate_number(key: str, item: Any) -> Any:
    """``item`` as generate takes ``key`` (float, or int where whole), refused in one line
    where it is not a number in ``key``'s range; a key without a range is kept as given."""
    if key not in _GENERATE_NUMBERS:
        return item
    whole, low, low_allowed, high = _GENERATE_NUMBERS[key]
    number = isinstance(item, (int, float)) and not isinstance(item, bool)
    if number and whole and not float(item).is_integer():
        raise UsageError(f"--gen-kwargs {key}={item!r}: must be a whole number >= {low}")
    if not number or item < low or (item == low and not low_allowed) or (
            high is not None and item > high):
        allowed = (f"between {low} and {high}" if high is not None
                   else f"{'>=' if low_allowed else 'above'} {low}")
        kind = "whole number" if whole else "number"
        raise UsageError(f"--gen-kwargs {key}={item!r}: must be a {kind} {allowed}")
    return int(item) if whole else float(item)


def parse_gen_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``--gen-kwargs`` as a dict, read as the ``lm_eval`` command reads its
    ``--gen_kwargs``: a JSON object, or ``key=value,...`` whose values are Python literals
    where they parse as one (``until=["\\n\\n"]``, ``max_gen_toks=256``, ``do_sample=true``).
    Which keys a model's ``generate`` takes is checked once the tasks are known
    (``engine.check_task_overrides``)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        parsed: Any = dict(value)
    else:
        text = str(value).strip()
        if text.startswith("{"):
            import json

            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError) as err:
                raise UsageError(f"--gen-kwargs {value!r}: not a JSON object ({err})") \
                    from None
        else:
            from lm_eval_headloc.measurement.lm_eval_output import cli_args_dict

            try:
                parsed = cli_args_dict(text) if "=" in text else None
            except (ValueError, SyntaxError):
                parsed = None
            if parsed is None or any(not str(key).strip() for key in parsed):
                raise UsageError(f"--gen-kwargs {value!r}: must be key=value pairs joined by "
                                 "commas (e.g. max_gen_toks=256,temperature=0) or a JSON "
                                 "object")
            parsed = {str(key).strip(): item for key, item in parsed.items()}
    if not isinstance(parsed, dict) or not parsed:
        raise UsageError(f"--gen-kwargs {value!r}: must name at least one generation argument "
                         "(e.g. max_gen_toks=256)")
    tokens = parsed.get("max_gen_toks", 1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UsageError(f"--gen-kwargs max_gen_toks={_as_written(value, 'max_gen_toks', tokens)}"
                         ": must be a whole number >= 1")
    for key, item in parsed.items():
        number = isinstance(item, (int, float)) and not isinstance(item, bool)
        if number and not math.isfinite(item):
            raise UsageError(f"--gen-kwargs {key}={_as_written(value, key, item)}: must be a "
                             "finite number")
        parsed[key] = _generate_number(key, item)
    if "do_sample" in parsed and not isinstance(parsed["do_sample"], bool):
        raise UsageError(f"--gen-kwargs do_sample={parsed['do_sample']!r}: must be true or "
                         "false")
    until = parsed.get("until")
    if until is not None and not (isinstance(until, str) or (
            isinstance(until, list) and all(isinstance(u, str) for u in until))):
        raise UsageError(f"--gen-kwargs until={until!r}: must be a string or a list of "
                         "strings")
    if isinstance(until, str):  # lm-eval's generate_until reads one string as [it]
        parsed["until"] = [until]
    return parsed


def _as_written(value: Any, key: str, item: Any) -> str:
    """``key``'s value as the user wrote it in ``key=value,...`` text (lm-eval's parser
    reads ``-1`` as ``-1.0``, which an error must not show); otherwise its ``repr``."""
    if isinstance(value, str) and not value.strip().startswith("{"):
        written = re.search(rf"(?:^|,)\s*{re.escape(key)}\s*=\s*(.*?)\s*"
                            r"(?=,\s*[A-Za-z_][\w.]*\s*=|$)", value.strip())
        if written:
            return written.group(1)
    return repr(item)


def canonical_gen_kwargs(value: Any) -> Any:
    """``gen_kwargs`` as one JSON text with sorted keys, so that a run resumed with the
    same arguments in another order, as JSON instead of key=value, or with a value written
    otherwise (``temperature=0`` for ``0.0``, ``until="Q:"`` for ``["Q:"]``) is the same
    run; a value that does not parse is left
    for ``validate`` to refuse in one line."""
    import json

    try:
        parsed = parse_gen_kwargs(value)
    except UsageError:
        return value
    return None if parsed is None else json.dumps(parsed, sort_keys=True)


def path_list(paths: Iterable[str | Path]) -> list[str]:
    """Folders as absolute paths (what identity records, whatever the working directory)."""
    return [str(Path(p).resolve()) for p in paths]


#: The hf-headablate model args that are RunSpec fields (and so flags, recorded by runs).
ABLATION_FLAGS = {"ablation": "--ablation", "scale": "--scale",
                  "ablation_data": "--ablation-data", "ablation_field": "--ablation-field"}
_PICKS_HEADS = ("headloc-harness picks the heads each measurement knocks out (--exclude and "
                "--never-ablate keep heads out of the search)")
#: The hf-headablate model args the harness sets itself for every measurement, which in
#: --model-args would be silently overridden: why each is refused.
HARNESS_MODEL_ARGS = {
    "ablate": _PICKS_HEADS, "ablate_file": _PICKS_HEADS, "ablate_top": _PICKS_HEADS,
    "ablation_include_path": "give the folder as --include-path, where --ablation-data "
                             "finds its task",
    "ablation_cache": "a run keeps its mean statistics in its own folder (means/)",
    "batch_size": "give it as --batch-size, which the harness passes to the model",
}


def option(default: Any, help: str, role: str = RESULT, *, parse: Any = None,
            metavar: str | None = None, whole: bool | None = None,
            min_val: float | None = None, max_val: float | None = None,
            include_boundaries: str = "both", choices: Sequence[str] | None = None,
            switch: Any = None, legacy: Any = _SAME) -> Any:
    """A RunSpec field with what the CLI and ``validate`` need to know about it.

    ``switch``: a yes/no option — ``"store_true"`` or ``argparse.BooleanOptionalAction``.
    ``legacy``: the value that gives what run folders made before the field existed did,
    when that is not the default (``RunSpec.assumed_for_old_runs``).
    """
    number = None if whole is None else dict(whole=whole, min_val=min_val, max_val=max_val,
                                             include_boundaries=include_boundaries)
    return field(default=default, metadata=dict(
        help=help, role=role, parse=parse, metavar=metavar, number=number, choices=choices,
        switch=switch, legacy=default if legacy is _SAME else legacy))


def check_model_args(model_args: str) -> None:
    """Refuse --model-args that name what the run sets itself (``ABLATION_FLAGS``'
    arguments, recorded as flags; ``HARNESS_MODEL_ARGS``), in one line naming why."""
    parsed = ModelArgs.parse(model_args)
    twice = parsed.given_twice()
    if twice is not None:  # lm-eval keeps the last: the first would be dropped unsaid
        raise UsageError(f"--model-args {twice}= is given twice; give it once")
    given = parsed.names
    refused = {**{name: f"give it as {flag}, which the run records"
                  for name, flag in ABLATION_FLAGS.items()}, **HARNESS_MODEL_ARGS}
    clash = sorted(given & set(refused))
    if clash:
        raise UsageError(f"--model-args {clash[0]}=...: {refused[clash[0]]}")


def refuse_keywords(command: str, options: Iterable[str], takes: Iterable[str]) -> None:
    """A TypeError naming the ``options`` that ``command``'s Python function does not take,
    and those it does."""
    takes = set(takes)
    unknown = sorted(set(options) - takes)
    if unknown:
        raise TypeError(f"{command}() got {', '.join(unknown)}, which it does not take; it "
                        f"takes {', '.join(sorted(takes))}")
