"""Head notation: parsing, formatting, validation and head files."""

import json

import pytest

from lm_eval_headloc.heads import (
    Head,
    HeadSpecError,
    check_head_names,
    check_top,
    format_heads,
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
    with pytest.raises(HeadSpecError, match="whole layer"):
        parse_heads("L1H*")


def test_flat_index_round_trip():
    assert Head(2, 3).flat_index(9) == 21
    assert Head.from_flat_index(21, 9) == Head(2, 3)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("L99H0", r"L99H0.*layer 99 not in 0\.\.1 \(2 layers\)"),
        ("L0H9", r"L0H9.*head 9 not in 0\.\.3 \(4 heads per layer\)"),
        ("X1", r"bad head name 'X1'"),
        ("L-1H0", r"bad head name 'L-1H0'"),
        ("L0H1++L1H2", r"empty head name"),
        ("L0H1+", r"empty head name"),
        ("", r"head list is empty"),
        ("l0h1", r"bad head name 'l0h1'"),
    ],
)
def test_bad_heads_name_the_value_and_the_allowed_range(spec, message):
    with pytest.raises(HeadSpecError, match=message) as info:
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


def test_read_heads_file_errors(tmp_path):
    with pytest.raises(HeadSpecError, match="head file not found: .*missing.json"):
        read_heads_file(tmp_path / "missing.json")
    path = tmp_path / "h.txt"
    path.write_text("L0H1\nL0H2\n")
    with pytest.raises(HeadSpecError, match="ablate_top=3 but .* lists only 2"):
        read_heads_file(path, top=3)
    with pytest.raises(HeadSpecError, match="ablate_top=0"):
        read_heads_file(path, top=0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HeadSpecError, match="not valid JSON"):
        read_heads_file(bad)


def test_head_names_are_checked_without_a_model():
    check_head_names("L3H*+L0H29+L12H0")  # whole layers parse without a head count
    check_head_names([Head(0, 1), (2, 3), "L1H*"])
    for spec, message in [("X1", "bad head name 'X1'"), ("l0h0", "bad head name 'l0h0'"),
                          ("L*H1", r"bad head name 'L\*H1'"),
                          ("L0H1++L1H2", "empty head name"), ("", "head list is empty")]:
        with pytest.raises(HeadSpecError, match=message) as info:
            check_head_names(spec)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("pair, message", [
    ((0, 1.5), r"bad head \(0, 1\.5\): head=1\.5: must be a whole number"),
    ((True, 0), r"bad head \(True, 0\): layer=True: must be a whole number"),
    (("0", 1), r"bad head \('0', 1\): layer='0': must be a whole number"),
    (5, r"bad head 5: expected a name like 'L0H29', a Head or a \(layer, head\) pair"),
    ((1, 2, 3), r"bad head \(1, 2, 3\): expected"),
])
def test_pairs_from_python_must_be_two_whole_numbers(pair, message):
    # (0, 1.5) used to become L0H1 silently, 5 a TypeError.
    with pytest.raises(HeadSpecError, match=message):
        parse_heads([pair])
    import numpy as np

    assert parse_heads([(np.int64(1), np.int32(2))]) == [Head(1, 2)]


@pytest.mark.parametrize("top", [True, 0, -1, 2.5, "3", [2]])
def test_ablate_top_is_a_whole_number_from_one(top, tmp_path):
    # Checked before the file is even looked for.
    with pytest.raises(HeadSpecError, match=r"ablate_top=.*: must be a whole number >= 1"):
        read_heads_file(tmp_path / "missing.json", top=top)
    with pytest.raises(HeadSpecError, match=r"ablate_top=.*: must be a whole number >= 1"):
        check_top(top)
    assert check_top(3) == 3
