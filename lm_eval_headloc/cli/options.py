"""``RunSpec``'s fields as argparse flags: names, defaults, help and types taken from the
fields, never restated (``add_options``)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.runs.option_values import comma_list, flag_of
from lm_eval_headloc.runs.spec import RunSpec

__all__ = ["LM_EVAL_SPELLING", "add_options"]


#: Options that are lm-eval's own: their flags take lm-eval's spelling (--output_path) too.
LM_EVAL_SPELLING = frozenset({"model_args", "include_path", "batch_size", "output_path",
                              "log_samples", "num_fewshot", "gen_kwargs",
                              "system_instruction"})


def add_options(parser: argparse.ArgumentParser, names: Iterable[str],
                keep_stored: bool | str = False) -> None:
    """Add the flags of these RunSpec fields, defaults taken from the fields.

    ``keep_stored``: every default is None, meaning "as stored in the run" (refit); a
    string says what None stands for instead of "the run's" (cross: "the runs' own tasks").
    """
    by_name = {f.name: f for f in fields(RunSpec)}
    for name in names:
        spec_field = by_name[name]
        meta, flag = spec_field.metadata, flag_of(name)
        # lm-eval's own spelling is accepted too where the option is lm-eval's.
        spellings = (flag, f"--{name}") if name in LM_EVAL_SPELLING else (flag,)
        default = None if keep_stored else spec_field.default
        stored = keep_stored if isinstance(keep_stored, str) else "the run's"
        shown = stored if keep_stored else (
            ",".join(default) if isinstance(default, tuple) else default)
        text = meta["help"]
        if keep_stored:  # the field's own default is not what a stored run uses
            # (one level of parentheses inside it: --masks' "(see --confirm)")
            text = re.sub(r" \(default: (?:[^()]|\([^()]*\))*\)", "", text)
        say_default = shown is not None and shown != "" and "default:" not in text
        # argparse %-formats help texts.
        help_text = (text + (f" (default: {shown})" if say_default else "")).replace("%", "%%")
        if meta["switch"] is not None:
            parser.add_argument(*spellings, action=meta["switch"],
                                default=None if keep_stored else spec_field.default,
                                help=(text + (f" (default: {stored})" if keep_stored else ""))
                                .replace("%", "%%"))
            continue
        kwargs: dict[str, Any] = dict(default=default, help=help_text)
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        if name == "include_path":
            kwargs.update(action="append", default=[])
        elif meta["parse"] is not None:
            kwargs["type"] = _argparse_type(meta["parse"], flag)
        parser.add_argument(*spellings, **kwargs)


def _argparse_type(parse: Any, flag: str) -> Any:
    numeric = parse is not comma_list

    def convert(text: str) -> Any:
        if numeric and not text.isascii():  # int() reads Arabic-Indic and other digits
            raise argparse.ArgumentTypeError(f"{text!r}: only ASCII digits are read as "
                                              "numbers")
        try:
            return parse(text)
        except (ValueError, UsageError) as err:
            reason = str(err) if isinstance(err, UsageError) else (
                f"{text!r} is not a {'whole number' if parse is int else 'number'}")
            raise argparse.ArgumentTypeError(reason) from None

    convert.__name__ = flag
    return convert
