"""Head notation: parsing, formatting, validation, head files and inline head lists."""

import itertools
import json

import numpy as np
import pytest
from helpers import raises_naming

from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    Head,
    Neuron,
    check_component_names,
    check_head_names,
    check_top,
    format_heads,
    parse_components,
    parse_heads,
    read_heads_file,
)


def test_parse_format_round_trip_is_sorted_and_unique():
    heads = parse_heads("L1H31+L0H29+L1H31")
    assert heads == [Head(0, 29), Head(1, 31)]
    assert format_heads(heads) == "L0H29+L1H31"
    assert parse_heads(format_heads(heads)) == heads
    assert parse_heads("L1H31+L0H29") == parse_heads("L0H29+L1H31")


def test_whole_layer_expands_with_the_model_head_count():
    assert parse_heads("L1H*+L0H0", num_layers=2, heads_per_layer=3) == [
        Head(0, 0), Head(1, 0), Head(1, 1), Head(1, 2)]
    with raises_naming(ComponentSpecError, "'L1H*'"):
        parse_heads("L1H*")


def test_flat_index_round_trip():
    assert Head(2, 3).flat_index(9) == 21
    assert Head.from_flat_index(21, 9) == Head(2, 3)


@pytest.mark.parametrize(
    "spec, values",
    [
        ("L99H0", ("L99H0", "0..1")),  # the head and the layers there are
        ("L0H9", ("L0H9", "0..3")),
        ("X1", ("'X1'",)),
        ("L-1H0", ("'L-1H0'",)),
        ("L0H1++L1H2", ("empty head name",)),  # no value to name
        ("L0H1+", ("empty head name",)),
        ("", ("head list is empty",)),
        ("l0h1", ("'l0h1'",)),
        ("L\u0660H\u0660", ("'L\u0660H\u0660'",)),  # Arabic-Indic digits: not a head
    ],
)
def test_bad_heads_name_the_value_and_the_allowed_range(spec, values):
    with raises_naming(ComponentSpecError, *values) as info:
        parse_heads(spec, num_layers=2, heads_per_layer=4)
    assert "\n" not in str(info.value)


def test_read_heads_file_json_ranked_and_text(tmp_path):
    ranked = tmp_path / "heads.json"
    ranked.write_text(json.dumps({"heads": [
        {"head": "L3H1", "coef": -0.4}, {"head": "L0H2", "coef": -0.3},
        {"head": "L5H5", "coef": -0.1}]}))
    assert read_heads_file(ranked) == ["L3H1", "L0H2", "L5H5"]
    assert read_heads_file(ranked, top=2) == ["L3H1", "L0H2"]
    plain = tmp_path / "list.json"
    plain.write_text('["L1H1", "L2H2"]')
    assert read_heads_file(plain) == ["L1H1", "L2H2"]
    text = tmp_path / "heads.txt"
    text.write_text("# universal heads\nL0H8\n\nL1H8+L1H7  # a pair\n")
    assert read_heads_file(text) == ["L0H8", "L1H8", "L1H7"]
    # A byte-order mark (Windows Notepad's UTF-8) was read as part of the first name.
    text.write_bytes(b"\xef\xbb\xbfL0H8\r\nL1H8\r\n")
    assert read_heads_file(text) == ["L0H8", "L1H8"]
    plain.write_bytes(b'\xef\xbb\xbf["L1H1"]')
    assert read_heads_file(plain) == ["L1H1"]
    # A head named again inside a "+"-joined JSON entry (kept whole: a group's neurons)
    # passed in JSON, where the same list as text lines was refused.
    pairs = tmp_path / "pairs.json"
    pairs.write_text('["L0H1+L1H2", "L0H1"]')
    with raises_naming(ComponentSpecError, str(pairs), "L0H1 twice"):
        read_heads_file(pairs)


def test_read_heads_file_errors(tmp_path):
    with raises_naming(ComponentSpecError, str(tmp_path / "missing.json")):
        read_heads_file(tmp_path / "missing.json")
    path = tmp_path / "h.txt"
    path.write_text("L0H1\nL0H2\n")
    with raises_naming(ComponentSpecError, "ablate_top=3", str(path), "lists only 2 entries"):
        read_heads_file(path, top=3)
    path.write_text("L0H1\n")  # a file of one
    with raises_naming(ComponentSpecError, "ablate_top=3", "lists only 1 entry"):
        read_heads_file(path, top=3)
    path.write_text("L0H1\nL0H2\n")
    with pytest.raises(ComponentSpecError, match="ablate_top=0"):
        read_heads_file(path, top=0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with raises_naming(ComponentSpecError, str(bad), "JSON"):
        read_heads_file(bad)


def test_a_run_folder_given_as_a_head_file_is_told_its_ranking(tmp_path):
    """ablate_file=runs/smol said only 'is a folder, not a head file'."""
    run, sweep, other = tmp_path / "run", tmp_path / "sweep", tmp_path / "other"
    for folder in (run, sweep / "m4-p0.1", other):
        folder.mkdir(parents=True)
    for ranking in (run / "heads.json", run / "heads-t.json", sweep / "m4-p0.1" / "heads.json"):
        ranking.write_text('{"heads": ["L0H1"]}')
    with raises_naming(ComponentSpecError, f"{run} is a folder", f"e.g. {run / 'heads.json'}"):
        read_heads_file(run)
    with raises_naming(ComponentSpecError, f"e.g. {sweep / 'm4-p0.1' / 'heads.json'}"):
        read_heads_file(sweep)
    with pytest.raises(ComponentSpecError) as refused:
        read_heads_file(other)
    assert str(refused.value) == f"{other} is a folder, not a head file"


def test_a_head_file_that_is_not_one_is_refused_without_printing_its_text(tmp_path):
    """--exclude /etc/shadow printed the file's first line in its error ("bad component
    name 'root:*:...'"): the file and the line are named, not its text; a misspelt head
    is still shown, as the user wrote it."""
    secret = "toor:$6$pepper$digest:19000:0:99999:7:::"
    for name, text in (("shadow", secret + "\n"), ("secret.json", json.dumps([secret])),
                       ("records.json", json.dumps({"heads": [{"head": 3}]}))):
        path = tmp_path / name
        path.write_text(text)
        with raises_naming(ComponentSpecError, str(path)) as info:
            read_heads_file(path)
        assert "toor" not in str(info.value) and "digest" not in str(info.value)
        assert "\n" not in str(info.value)
    typo = tmp_path / "heads.txt"
    typo.write_text("L0H1\nL0H1x\n")
    with raises_naming(ComponentSpecError, str(typo), "line 2", "L0H1x"):
        read_heads_file(typo)


def test_head_names_are_checked_without_a_model():
    check_head_names("L3H*+L0H29+L12H0")  # whole layers parse without a head count
    check_head_names([Head(0, 1), (2, 3), "L1H*"])
    for spec, value in [("X1", "'X1'"), ("l0h0", "'l0h0'"), ("L*H1", "'L*H1'"),
                        ("L0H1++L1H2", "empty head name"), ("", "head list is empty")]:
        with raises_naming(ComponentSpecError, value) as info:
            check_head_names(spec)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("pair, values", [
    ((0, 1.5), ("(0, 1.5)", "head=1.5")),
    ((True, 0), ("(True, 0)", "layer=True")),
    (("0", 1), ("('0', 1)", "layer='0'")),
    (5, ("5", "'L0H29'", "(layer, head)")),  # the forms a head may take
    ((1, 2, 3), ("(1, 2, 3)", "(layer, head)")),
])
def test_pairs_from_python_must_be_two_whole_numbers(pair, values):
    # (0, 1.5) used to become L0H1 silently, 5 a TypeError.
    with raises_naming(ComponentSpecError, *values):
        parse_heads([pair])
    import numpy as np

    assert parse_heads([(np.int64(1), np.int32(2))]) == [Head(1, 2)]


@pytest.mark.parametrize("top", [True, 0, -1, 2.5, "3", [2]])
def test_ablate_top_is_a_whole_number_from_one(top, tmp_path):
    # Checked before the file is even looked for.
    with raises_naming(ComponentSpecError, f"ablate_top={top!r}", ">= 1"):
        read_heads_file(tmp_path / "missing.json", top=top)
    with raises_naming(ComponentSpecError, f"ablate_top={top!r}", ">= 1"):
        check_top(top)
    assert check_top(3) == 3


@pytest.mark.parametrize("written, refused", [("-3", True), ("-1", True), ("0", True),
                                               ("+2", False), ("2", False)])
def test_ablate_top_from_lm_evals_command_line_is_told_as_written(written, refused):
    """``lm-eval run --model_args ablate_top=-3`` reached the model as -3.0 (lm-eval's
    command line types a signed number as a float), and the error said ablate_top=-3.0;
    ``+2`` was refused as 2.0."""
    from lm_eval._cli.utils import key_val_to_dict  # what `lm-eval run` gives the model

    given = key_val_to_dict(f"ablate_top={written}")["ablate_top"]
    if not refused:
        assert check_top(given) == int(written)
        return
    with raises_naming(ComponentSpecError, f"ablate_top={int(written)}:", ">= 1",
                       "whole number") as caught:
        check_top(given)
    assert ".0" not in str(caught.value)


@pytest.mark.parametrize("per_layer", [1, 3, 4])
def test_flat_index_is_layer_major_for_every_head(per_layer):
    # The design's columns, written out: layer 0's heads, then layer 1's, ...
    columns = list(itertools.product(range(3), range(per_layer)))
    for index, (layer, head) in enumerate(columns):
        assert Head(layer, head).flat_index(per_layer) == index
        assert Head.from_flat_index(index, per_layer) == Head(layer, head)
    assert Head.from_flat_index(np.int64(5), np.int32(3)) == Head(1, 2)


@pytest.mark.parametrize("call, values", [
    # Head 5 does not exist in a layer of 4: its sum (9) is L2H1's column.
    (lambda: Head(1, 5).flat_index(4), ("L1H5", "heads_per_layer=4", "0..3")),
    (lambda: Head(1, -1).flat_index(4), ("L1H-1", "heads_per_layer=4")),
    (lambda: Head(-1, 2).flat_index(4), ("L-1H2", ">= 0")),
    (lambda: Head(0, 0).flat_index(0), ("heads_per_layer=0", ">= 1")),
    (lambda: Head.from_flat_index(-1, 4), ("index=-1", ">= 0")),
    (lambda: Head.from_flat_index(3, 0), ("heads_per_layer=0", ">= 1")),
    (lambda: Head.from_flat_index(2.5, 4), ("index=2.5",)),
    (lambda: Head.from_flat_index(3, True), ("heads_per_layer=True",)),
])
def test_flat_index_refuses_heads_and_counts_that_do_not_fit(call, values):
    with raises_naming(ComponentSpecError, *values) as info:
        call()
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


@pytest.mark.parametrize("call, values", [
    (lambda: parse_heads("L5H1", num_layers=2), ("L5H1", "0..1")),
    (lambda: parse_heads("L5H9", heads_per_layer=4), ("L5H9", "0..3")),
    (lambda: parse_components("L5N1", num_layers=2), ("L5N1", "0..1")),
    (lambda: parse_components("L0N9", neurons_per_layer=4), ("L0N9", "0..3")),
    (lambda: parse_components("L0N9", 2, None, 4), ("L0N9", "0..3")),
    (lambda: parse_heads("L2H0", head_layers=[1, 3]), ("L2H0", "1, 3")),  # layers with heads
    (lambda: parse_heads([(0, -1)], num_layers=2), ("L0H-1", ">= 0")),
])
def test_each_bound_given_is_checked(call, values):
    # Only one of num_layers / heads_per_layer used to check nothing (L5H1 of 2 layers).
    with raises_naming(ComponentSpecError, *values) as info:
        call()
    assert "\n" not in str(info.value)


def test_a_single_bound_leaves_the_other_unchecked():
    assert parse_heads("L1H9", num_layers=2) == [Head(1, 9)]
    assert parse_heads("L7H3+L5H*", heads_per_layer=4) == [
        Head(5, 0), Head(5, 1), Head(5, 2), Head(5, 3), Head(7, 3)]
    assert parse_components("L9N3+L1H7", neurons_per_layer=4) == [Head(1, 7), Neuron(9, 3)]
    # Checking names without a model expands L3H*, yet bounds nothing.
    check_head_names("L0H29+L3H*")
    check_component_names("L0N1234+L3N*+L0H29")


def test_format_heads_takes_names_components_and_pairs(tmp_path):
    assert format_heads(["L1H2", "L0H1"]) == "L0H1+L1H2"
    assert format_heads("L1H2+L0H1+L1H2") == "L0H1+L1H2"
    assert format_heads([Head(1, 0), "L0N7", (0, 29), "L0H29+L1H0"]) == "L0H29+L0N7+L1H0"
    assert format_heads([(np.int64(2), np.int64(3))]) == "L2H3"
    assert format_heads([]) == "" and format_heads("") == ""
    path = tmp_path / "heads.txt"
    path.write_text("L3H1\nL0H2+L0N5\n")
    assert format_heads(read_heads_file(path)) == "L0H2+L0N5+L3H1"


@pytest.mark.parametrize("heads, values", [
    ([(-1, 2)], ("L-1H2", ">= 0")),
    ([Head(0, -3)], ("L0H-3",)),
    ([Neuron(-2, 1)], ("L-2N1",)),
    (["L0H1", "X1"], ("'X1'",)),
    ([(0, 1.5)], ("(0, 1.5)",)),
    ("L3H*", ("'L3H*'",)),
])
def test_format_heads_refuses_what_parse_heads_refuses(heads, values):
    # (-1, 2) used to format as 'L-1H2', a name parse_heads refuses.
    with raises_naming(ComponentSpecError, *values) as info:
        format_heads(heads)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name, text, values", [  # the file, where in it, what is there
    ("junk.txt", "L0H1\ngarbage\n", ("line 2", "not a head name")),  # text not shown
    ("spaces.txt", "# two\nL0H1 L1H2\n", ("line 2", "'L0H1 L1H2'", "'+'")),
    ("plus.txt", "L0H1+\n", ("line 1",)),
    ("list.json", '["L0H1", "nope"]', ("entry 2", "not a head name")),
    ("empty.json", '{"heads": [{"head": ""}]}', ("entry 1", "''")),
    ("spaces.json", '["L0H1  L1H2"]', ("entry 1", "'L0H1  L1H2'")),
    ("group.json", '{"heads": [{"group": "L3G0", "neurons": "L3N1+L3X2"}]}',
     ("entry 1", "'L3X2'")),
])
def test_read_heads_file_refuses_malformed_names(tmp_path, name, text, values):
    # Used to come back as names: ['garbage'], ['L0H1 L1H2'].
    path = tmp_path / name
    path.write_text(text)
    with raises_naming(ComponentSpecError, str(path), *values) as info:
        read_heads_file(path)
    assert "\n" not in str(info.value)


def test_read_heads_file_keeps_groups_whole_layers_and_neurons(tmp_path):
    ranked = tmp_path / "heads.json"
    ranked.write_text(json.dumps({"heads": [
        {"neuron": "L2N7"}, {"group": "L3G0", "neurons": "L3N1+L3N4"}, {"head": "L0H1"}]}))
    assert read_heads_file(ranked) == ["L2N7", "L3N1+L3N4", "L0H1"]
    text = tmp_path / "heads.txt"
    text.write_text("L3H*\n L0H1 + L2N5 \n")
    assert read_heads_file(text) == ["L3H*", "L0H1", "L2N5"]
    # ablate_top counts as docs/model.md says: a text line's heads one by one, a JSON
    # item whole.
    assert read_heads_file(text, top=2) == ["L3H*", "L0H1"]  # a whole layer: one entry
    assert read_heads_file(ranked, top=2) == ["L2N7", "L3N1+L3N4"]


# --- head lists on the command line -------------------------------------------------------

def test_a_long_inline_head_list_is_heads_not_a_file_name(tmp_path, monkeypatch):
    """--never-ablate with 261 heads inline (an audit's run on the embedded model): the
    check for a file of that name raised 'File name too long' as a traceback."""
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.intervention.components import Head
    from lm_eval_headloc.runs.setup import head_list

    monkeypatch.chdir(tmp_path)
    names = [f"L{layer}H{head}" for layer in range(1, 30) for head in range(9)]
    assert len("+".join(names)) > 255  # longer than a file name may be
    assert head_list("+".join(names), 30, 9, "--never-ablate") == [
        Head(layer, head) for layer in range(1, 30) for head in range(9)]
    # A file is still read as one, and a bad name is still a one-line error.
    (tmp_path / "keep.txt").write_text("L0H1\nL2H3\n")
    assert head_list("keep.txt", 30, 9, "--never-ablate") == [Head(0, 1), Head(2, 3)]
    with raises_naming(UsageError, "--never-ablate", "L40H0", "0..29"):
        head_list("+".join([*names, "L40H0"]), 30, 9, "--never-ablate")


@pytest.mark.parametrize("name, text", [
    ("heads.txt", "L0H1\nL1H2\nL0H1\n"),
    ("plus.txt", "L0H1+L1H2+L0H1\n"),
    ("ranking.json", json.dumps({"heads": [{"head": "L0H1"}, {"head": "L1H2"},
                                           {"head": "L0H1"}]})),
])
def test_a_head_named_twice_is_refused(tmp_path, name, text):
    """overlap read a file naming a head twice and gave a rate of 1.0 where it was 0.8."""
    path = tmp_path / name
    path.write_text(text)
    with raises_naming(ComponentSpecError, str(path), "L0H1 twice", "1 and 3"):
        read_heads_file(path)


@pytest.mark.parametrize(("name", "size", "said"), [
    ("L1H0", (1, 9, 4), "layer 1 not in 0..0 (1 layer)"),
    ("L0H1", (30, 1, 4), "head 1 not in 0..0 (1 head per layer)"),
    ("L0N1", (30, 9, 1), "neuron 1 not in 0..0 (1 MLP neuron per layer)"),
    ("L30H0", (30, 9, 4), "layer 30 not in 0..29 (30 layers)"),
    ("L0H9", (30, 9, 4), "head 9 not in 0..8 (9 heads per layer)"),
    ("L0N4", (30, 9, 4), "neuron 4 not in 0..3 (4 MLP neurons per layer)"),
])
def test_outside_the_model_counts_its_size_in_words(name, size, said):
    """A one-layer toy model read 'layer 1 not in 0..0 (1 layers)'."""
    from lm_eval_headloc.intervention.components import validate_heads

    with pytest.raises(ComponentSpecError) as refused:
        validate_heads(parse_components([name]), *size)
    assert str(refused.value).endswith(f"is outside the model: {said}")
