"""lm-eval's --model_args text, parsed in one place (intervention.arg_string.ModelArgs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lm_eval.utils import simple_parse_args_string

from lm_eval_headloc.intervention.arg_string import ModelArgs

TEXT = "pretrained=org/model, device=cuda:1,dtype=bfloat16,trust_remote_code=True,max_length=512"


def test_the_values_are_lm_evals_reading_and_the_names_are_stripped():
    parsed = ModelArgs.parse(TEXT)
    # The reference: lm-eval's own parser on the same text, typed values and all.
    assert dict(parsed.args) == simple_parse_args_string(TEXT)
    assert parsed.args["max_length"] == 512 and parsed.args["trust_remote_code"] is True
    assert parsed.names == {"pretrained", "device", "dtype", "trust_remote_code", "max_length"}
    assert "device" in parsed and "peft" not in parsed
    assert parsed.get("dtype") == "bfloat16" and parsed.get("peft", "none") == "none"


def test_one_parse_per_text_and_none_has_no_arguments():
    assert ModelArgs.parse(TEXT) is ModelArgs.parse(TEXT)
    assert ModelArgs.parse(None).names == ModelArgs.parse("").names == frozenset()
    assert dict(ModelArgs.parse(None).args) == {}


def test_dropping_an_argument_keeps_every_other_part_as_written():
    assert ModelArgs.parse(TEXT).without("device") == (
        "pretrained=org/model,dtype=bfloat16,trust_remote_code=True,max_length=512")
    assert ModelArgs.parse("pretrained=a,,device=cpu").without("device") == "pretrained=a"
    assert ModelArgs.parse(TEXT).without() == TEXT  # nothing dropped: as written


def test_a_check_of_the_names_does_not_import_lm_eval():
    code = ("import sys\nfrom lm_eval_headloc.intervention.arg_string import ModelArgs\n"
            "assert 'device' in ModelArgs.parse('pretrained=x,device=cpu')\n"
            "print('lm_eval' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_no_other_module_parses_model_args():
    package = Path(__file__).resolve().parents[1] / "lm_eval_headloc"
    parsing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if "simple_parse_args_string(" in path.read_text()
                     or "model_args.split(" in path.read_text())
    assert parsing == ["intervention/arg_string.py"]


def test_a_whole_float_reads_back_as_the_number_written():
    """``lm-eval run``'s command line types ``-3`` as -3.0: ``as_written`` gives the int
    back, and leaves everything else (2.5, True, "3", None) as it is for the checks to
    refuse or take."""
    from lm_eval._cli.utils import handle_cli_value_string

    from lm_eval_headloc.intervention.arg_string import as_written

    typed = [handle_cli_value_string(text) for text in ("-3", "+4")]
    assert [type(v) for v in typed] == [float, float]  # why as_written exists
    assert [(as_written(v), type(as_written(v))) for v in typed] == [(-3, int), (4, int)]
    for kept in (2.5, True, "3", None, 7):
        assert as_written(kept) is kept
