"""Head types (previous-token, duplicate-token, induction, attention sink) from attention
patterns: hand-built patterns with hand-computed scores, tiny real models (one with heads
forced by hand-set weights), the labelling rule, the probe, and the embedded SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import raises_naming

from lm_eval_headloc.method.head_types import (
    DOMINANT_FLOOR,
    HEAD_TYPES,
    LABEL_MARGIN,
    PROBE_FIRST_ID,
    attention_patterns,
    borderline,
    dominant_type,
    encode_texts,
    head_type_scores,
    probe_type_scores,
    repeated_probe,
    type_scores_from_patterns,
    type_thresholds,
)

# --- hand-built patterns -------------------------------------------------------------


def rows_to(targets: list[int]) -> np.ndarray:
    """A (T, T) pattern whose row i puts all its weight on key targets[i]."""
    pattern = np.zeros((len(targets), len(targets)))
    pattern[np.arange(len(targets)), targets] = 1.0
    return pattern


def uniform(size: int) -> np.ndarray:
    """Causal uniform attention: row i spreads 1/(i+1) over keys 0..i."""
    return np.tril(np.ones((size, size))) / np.arange(1, size + 1)[:, None]


REPEATED = [5, 6, 7, 5, 6, 7]  # L = 3 tokens, twice, no first token
PREVIOUS = rows_to([0, 0, 1, 2, 3, 4])
INDUCTION = rows_to([0, 0, 0, 1, 2, 3])  # rows 3..5 -> i - L + 1; rows 0..2 on position 0
DUPLICATE = rows_to([0, 1, 2, 0, 1, 2])  # rows 3..5 -> i - L; rows 0..2 on themselves
SINK = rows_to([0, 0, 0, 0, 0, 0])
UNIFORM = uniform(6)
# By hand, on REPEATED: previous and sink count queries 1..5; duplicate and induction
# count queries 3, 4, 5, whose duplicate targets are 0, 1, 2 and induction targets 1, 2, 3.
U_PREV = (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5 + 1 / 6) / 5  # uniform: weight 1/(i+1) everywhere
U_REPEAT = (1 / 4 + 1 / 5 + 1 / 6) / 3
EXPECTED = {  # head -> (previous_token, duplicate_token, induction, attention_sink)
    "previous": (1.0, 0.0, 0.0, 1 / 5),          # only row 1's i-1 is position 0
    "induction": (1 / 5, 0.0, 1.0, 2 / 5),       # row 1 -> 0 is also previous; rows 1, 2 -> 0
    "duplicate": (0.0, 1.0, 0.0, 1 / 5),         # row 3 -> 0 is also the sink
    "sink": (1 / 5, 1 / 3, 0.0, 1.0),            # row 1 -> 0 is previous, row 3 -> 0 duplicate
    "uniform": (U_PREV, U_REPEAT, U_REPEAT, U_PREV),
}


def test_hand_built_heads_score_as_computed_by_hand():
    heads = {"previous": PREVIOUS, "induction": INDUCTION, "duplicate": DUPLICATE,
             "sink": SINK, "uniform": UNIFORM}
    order = list(heads)
    layer0 = np.stack([heads[name] for name in order])[None]  # (1, 5, 6, 6)
    layer1 = layer0[:, ::-1]  # the same heads in reverse order: layer and head stay apart
    scores = type_scores_from_patterns([layer0, torch.tensor(layer1.copy())],
                                       torch.tensor([REPEATED]))
    assert list(scores) == list(HEAD_TYPES)
    for name in HEAD_TYPES:
        assert scores[name].shape == (2, 5) and scores[name].dtype == np.float64
    for h, head in enumerate(order):
        got0 = [scores[name][0, h] for name in HEAD_TYPES]
        got1 = [scores[name][1, len(order) - 1 - h] for name in HEAD_TYPES]
        np.testing.assert_allclose(got0, EXPECTED[head], atol=1e-12, err_msg=head)
        np.testing.assert_allclose(got1, EXPECTED[head], atol=1e-12, err_msg=head)


def test_a_tensor_pattern_is_read_where_it_is_and_only_the_picked_weights_copied(
        monkeypatch):
    """A GPU's (batch, heads, T, T) pattern is gigabytes at a few thousand tokens: the
    scores pick their weights on its device and copy those alone."""
    from lm_eval_headloc.method import head_types

    heads = [PREVIOUS, INDUCTION, DUPLICATE, SINK, UNIFORM]
    layer = torch.tensor(np.stack(heads)[None], dtype=torch.float32)  # (1, 5, 6, 6)
    real = head_types._as_numpy
    copied = []

    def as_numpy(x):
        copied.append(tuple(np.shape(x)))
        return real(x)

    monkeypatch.setattr(head_types, "_as_numpy", as_numpy)
    scores = type_scores_from_patterns([layer], torch.tensor([REPEATED]))
    assert copied and all(len(shape) == 2 for shape in copied)  # (targets, heads) each
    for h, head in enumerate(["previous", "induction", "duplicate", "sink", "uniform"]):
        np.testing.assert_allclose([scores[name][0, h] for name in HEAD_TYPES],
                                   EXPECTED[head], atol=1e-6, err_msg=head)


def test_a_sequence_without_repeats_adds_no_zeros_and_alone_gives_nan():
    fresh = [8, 9, 10, 11, 12, 13]
    both = np.stack([UNIFORM, UNIFORM])[:, None]  # (2 sequences, 1 head, 6, 6)
    scores = type_scores_from_patterns([both], np.array([REPEATED, fresh]))
    # Both rows count for previous and sink (equal rows: the same mean); only the
    # repeated row counts for duplicate and induction, so their means are unchanged.
    np.testing.assert_allclose([scores[name][0, 0] for name in HEAD_TYPES],
                               EXPECTED["uniform"], atol=1e-12)
    alone = type_scores_from_patterns([UNIFORM[None, None]], np.array([fresh]))
    assert np.isnan(alone["duplicate_token"]).all() and np.isnan(alone["induction"]).all()
    assert alone["previous_token"][0, 0] == pytest.approx(U_PREV)
    assert alone["attention_sink"][0, 0] == pytest.approx(U_PREV)


def test_a_token_repeated_right_away_has_no_induction_target():
    # [4, 4]: query 1's duplicate is 0, its induction target would be 1 itself: not counted.
    scores = type_scores_from_patterns([uniform(2)[None, None]], np.array([[4, 4]]))
    assert scores["duplicate_token"][0, 0] == pytest.approx(0.5)
    assert np.isnan(scores["induction"][0, 0])


def test_the_most_recent_earlier_copy_is_the_target():
    # [3, 9, 3, 3]: query 2's duplicate is 0, query 3's is 2 (not 0); rows attend exactly
    # there, so duplicate is 1. Induction counts query 2 only (target 1, attended 0): 0.
    scores = type_scores_from_patterns([rows_to([0, 0, 0, 2])[None, None]],
                                       np.array([[3, 9, 3, 3]]))
    assert scores["duplicate_token"][0, 0] == 1.0 and scores["induction"][0, 0] == 0.0


def test_padding_is_ignored_on_either_side():
    # Left padding: pad id 0 twice (a "repeat" only if padding counted), then 7 8 7 8.
    ids = np.array([[0, 0, 7, 8, 7, 8]])
    mask = np.array([[0, 0, 1, 1, 1, 1]])
    # Real rows 2..5 attend the first real token, 2; the padded rows put theirs on 0.
    first_real = rows_to([0, 0, 2, 2, 2, 2])[None, None]
    scores = type_scores_from_patterns([first_real], ids, mask)
    # Sink: queries 3, 4, 5 -> 2: 1. Previous: only query 3's i-1 is 2: 1/3.
    # Duplicate: query 4 (7 at 2) -> 2 yes, query 5 (8 at 3) -> 3 no: 1/2.
    # Induction: query 4 -> 3, query 5 -> 4, neither attended: 0.
    np.testing.assert_allclose([scores[name][0, 0] for name in HEAD_TYPES],
                               [1 / 3, 1 / 2, 0.0, 1.0], atol=1e-12)
    # Without the mask the padded positions count (and change every score).
    unmasked = type_scores_from_patterns([first_real], ids)
    assert unmasked["attention_sink"][0, 0] == pytest.approx(1 / 5)

    # Right padding with garbage in the padded rows and a pad id that repeats real tokens.
    ids = np.array([[5, 6, 5, 6, 5, 5]])
    mask = np.array([[1, 1, 1, 1, 0, 0]])
    garbage = rows_to([0, 0, 0, 1, 4, 0])  # padded rows 4, 5 on a duplicate's keys 4, 0
    scores = type_scores_from_patterns([garbage[None, None]], ids, mask)
    # Real: 5 6 5 6. Previous: queries 1, 2, 3 -> 0, 1, 2; attended 0, 0, 1: 1/3.
    # Duplicate: query 2 -> 0 (yes), query 3 -> 1 (yes): 1. Induction: query 2 -> 1 (no),
    # query 3 -> 2 (no): 0. Sink: queries 1, 2, 3 -> 0: rows 1, 2: 2/3.
    np.testing.assert_allclose([scores[name][0, 0] for name in HEAD_TYPES],
                               [1 / 3, 1.0, 0.0, 2 / 3], atol=1e-12)


def test_patterns_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="batch, heads, query, key"):
        type_scores_from_patterns([np.zeros((1, 2, 5, 5))], np.zeros((1, 6), dtype=int))
    with pytest.raises(ValueError, match="attention_mask"):
        type_scores_from_patterns([np.zeros((1, 2, 6, 6))], np.zeros((1, 6), dtype=int),
                                  np.ones((1, 5)))


# --- the probe and text batches --------------------------------------------------------


def test_repeated_probe():
    probe = repeated_probe(100, length=8, batch=3, seed=1)
    assert probe.shape == (3, 16) and probe.dtype == torch.long
    assert torch.equal(probe[:, :8], probe[:, 8:])
    assert all(len(set(row[:8].tolist())) == 8 for row in probe)  # no repeat within a copy
    assert probe.min() >= PROBE_FIRST_ID and probe.max() < 99  # specials at either end
    assert torch.equal(probe, repeated_probe(100, length=8, batch=3, seed=1))
    assert not torch.equal(probe, repeated_probe(100, length=8, batch=3, seed=2))
    with_bos = repeated_probe(100, length=8, batch=3, seed=1, first_token=1)
    assert with_bos.shape == (3, 17) and (with_bos[:, 0] == 1).all()
    assert torch.equal(with_bos[:, 1:9], with_bos[:, 9:])
    # first_token is never drawn, so it has no duplicate in the probe.
    assert not (repeated_probe(30, length=8, batch=5, first_token=25)[:, 1:] == 25).any()
    with pytest.raises(ValueError, match="vocabulary"):
        repeated_probe(30, length=10)


def test_a_probe_scores_duplicates_and_induction_at_fixed_offsets():
    length = 4
    probe = repeated_probe(50, length=length, batch=1, first_token=1)  # 9 positions
    size = 2 * length + 1
    induction = rows_to([0] * (length + 1) + [i - length + 1 for i in range(length + 1, size)])
    duplicate = rows_to([0] * (length + 1) + [i - length for i in range(length + 1, size)])
    scores = type_scores_from_patterns([np.stack([induction, duplicate])[None]], probe)
    np.testing.assert_allclose(scores["induction"][0], [1.0, 0.0])
    np.testing.assert_allclose(scores["duplicate_token"][0], [0.0, 1.0])


class FakeTokenizer:
    pad_token_id = None
    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_encode_texts_pads_on_the_right():
    ids, mask = encode_texts(FakeTokenizer(), ["abc", "a"])
    assert ids.tolist() == [[97, 98, 99], [97, 2, 2]]  # no pad token: the EOS pads
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_types_read_a_chat_prompt_as_the_measurement_does(tiny_model_dir, tmp_path,
                                                          monkeypatch):
    """A tokenizer that adds a BOS (Llama 3's) and a chat template that writes one: lm-eval
    adds no second BOS to a text that begins with it, and the types' scores on the run's
    examples must read the same tokens, not [BOS, BOS, ...]."""
    import importlib
    import json
    import shutil

    from helpers import load_lm

    # The module that computes types.json's content.
    types_command = importlib.import_module("lm_eval_headloc.method.head_types")
    folder = tmp_path / "bos-model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tokenizer_file = folder / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<s>")
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [bos],
                                                         "tokens": ["<s>"]}}}
    tokenizer_file.write_text(json.dumps(spec))
    lm = load_lm(folder)
    assert lm.tokenizer("the cat")["input_ids"][0] == bos  # the tokenizer adds a BOS
    texts = ["<s>user: the cat sat</s><s>assistant:", "the dog sat on the mat"]
    seen = []
    monkeypatch.setattr(types_command, "head_type_scores",
                        lambda model, ids, mask=None, **kw: seen.append((ids, mask)) or {
                            t: np.zeros((2, 4)) for t in HEAD_TYPES})
    monkeypatch.setattr(types_command, "type_thresholds", lambda scores: {})
    monkeypatch.setattr(types_command, "dominant_type", lambda scores, **kw: [])
    monkeypatch.setattr(types_command, "borderline", lambda scores, errors: [])
    types_command.head_types_of(lm, texts)
    ids, mask = seen[-1]
    rows = [row[:int(m.sum())].tolist() for row, m in zip(ids, mask, strict=True)]
    assert rows == [lm.tok_encode(text) for text in texts]
    assert rows[0][:2] != [bos, bos] and rows[0][0] == bos and rows[1][0] == bos


# --- tiny real models ------------------------------------------------------------------


def tiny_config(family: str):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=128, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=128,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved_tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(f"head-types-{request.param}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(request.param))
    with torch.no_grad():  # sharper than the default init, so patterns are not ~uniform
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def load(folder, implementation: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=implementation)


def test_sdpa_model_gives_the_eager_patterns_and_keeps_sdpa(saved_tiny):
    sdpa, eager = load(saved_tiny, "sdpa"), load(saved_tiny, "eager")
    assert sdpa.config._attn_implementation == "sdpa"
    ids = repeated_probe(64, length=10, batch=2, first_token=1)
    with torch.no_grad():  # the eager copy's own output, not through the module
        expected = eager(input_ids=ids, output_attentions=True).attentions
    got = attention_patterns(sdpa, ids)
    assert len(got) == 2 and got[0].shape == (2, 2, 21, 21)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert sdpa.config._attn_implementation == "sdpa"  # put back
    sdpa.train()  # GPT-2's attention dropout would blur the weights: read in eval mode
    for a, b in zip(attention_patterns(sdpa, ids), expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert sdpa.training  # put back too

    scores = head_type_scores(sdpa, ids)
    assert list(scores) == list(HEAD_TYPES)
    for values in scores.values():
        assert values.shape == (2, 2) and np.all((values >= 0) & (values <= 1 + 1e-6))


def test_padded_batch_pools_the_unpadded_sequences(saved_tiny):
    model = load(saved_tiny, "sdpa")
    a = torch.tensor([[1, 20, 21, 22, 23, 20, 21, 22, 23, 30]])
    b = torch.tensor([[1, 40, 41, 40, 41, 42]])
    ids = torch.zeros((2, 10), dtype=torch.long)
    mask = torch.zeros((2, 10), dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, :6], mask[1, :6] = b[0], 1
    # By hand from each sequence's own unpadded pattern: the sub-diagonal's mean over
    # 9 and 5 queries, pooled over the 14; the first column's likewise.
    alone = [np.stack([p[0].numpy() for p in attention_patterns(model, x)]) for x in (a, b)]
    prev = [np.diagonal(x, offset=-1, axis1=-2, axis2=-1) for x in alone]  # (L, H, T-1)
    sink = [x[..., 1:, 0] for x in alone]
    expected_prev = (prev[0].sum(-1) + prev[1].sum(-1)) / 14
    expected_sink = (sink[0].sum(-1) + sink[1].sum(-1)) / 14
    for batch_size in (None, 1):
        scores = head_type_scores(model, ids, mask, batch_size=batch_size)
        np.testing.assert_allclose(scores["previous_token"], expected_prev, atol=1e-6)
        np.testing.assert_allclose(scores["attention_sink"], expected_sink, atol=1e-6)


def test_a_peft_wrapped_model_is_read_through_its_wrapper(saved_tiny):
    from peft import LoraConfig, get_peft_model

    model = load(saved_tiny, "sdpa")
    ids = repeated_probe(64, length=6, batch=1)
    plain = attention_patterns(model, ids)
    targets = ["c_attn"] if "gpt2" in saved_tiny.name else ["q_proj", "v_proj"]
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
    got = attention_patterns(wrapped, ids)  # LoRA's B starts at 0: the same patterns
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b)
    assert wrapped.base_model.model.config._attn_implementation == "sdpa"


class NoWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, input_ids, attention_mask=None, output_attentions=False):
        return type("Out", (), {"attentions": ()})()


def test_no_weights_is_a_clear_error_naming_the_model():
    with raises_naming(RuntimeError, "NoWeights", "output_attentions=True"):
        attention_patterns(NoWeights(), torch.zeros((1, 3), dtype=torch.long))


def forced_gpt2(positions: int = 16):
    """A GPT-2 whose layer 0 has a previous-token head (H0) and a sink head (H1) by
    hand-set weights; every other head keeps its random init.

    Token embeddings are zero and position p's embedding is a unit code c_p, the codes
    orthonormal and orthogonal to the all-ones vector (zero mean), so ln_1 only rescales
    them: its output u_p is known exactly. The query/key weights are then solved from
    those outputs: H0's query at p is s * e_p and its key at j is e_{j+1}, so the only
    large logit of query p is key p - 1; H1's query is s * e_0 everywhere and only key 0
    has e_0. With s = 80 and head size 16 the winning logit is 20 above the rest.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    embd, heads = 64, 4
    size = embd // heads
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=heads, n_embd=embd, vocab_size=64,
                                       n_positions=positions, bos_token_id=1, eos_token_id=2))
    model.eval()
    with torch.no_grad():
        start = torch.cat([torch.ones(embd, 1), torch.randn(embd, embd - 1)], dim=1)
        codes = torch.linalg.qr(start.double())[0][:, 1:1 + positions].T  # (positions, embd)
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.copy_(codes.float())
        block = model.transformer.h[0]
        solve = torch.linalg.pinv(block.ln_1(model.transformer.wpe.weight).double())
        eye = torch.eye(positions, size, dtype=torch.float64)
        scale = 80.0
        previous_q, previous_k = scale * eye, torch.zeros_like(eye)
        previous_k[:-1] = eye[1:]  # key j -> e_{j+1}
        sink_q, sink_k = torch.zeros_like(eye), torch.zeros_like(eye)
        sink_q[:, 0], sink_k[0, 0] = scale, 1.0
        weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias  # Conv1D: (in, 3E)
        bias.zero_()
        for head, (q, k) in enumerate([(previous_q, previous_k), (sink_q, sink_k)]):
            weight[:, head * size:(head + 1) * size] = (solve @ q).float()
            weight[:, embd + head * size:embd + (head + 1) * size] = (solve @ k).float()
    return model


def test_hand_set_weights_make_a_previous_token_and_a_sink_head():
    model = forced_gpt2()
    ids = repeated_probe(64, length=7, batch=2, first_token=1)  # 15 positions of 16
    scores = head_type_scores(model, ids)
    assert scores["previous_token"][0, 0] > 0.9
    assert scores["attention_sink"][0, 1] > 0.9
    labels = dominant_type(scores)
    # Attention to the first token is scored but labels no head (what the typical
    # head does is no type that a head stands out in).
    assert labels[0][0] == "previous_token" and labels[0][1] is None
    # The untouched heads attend near-uniformly (small random weights): none stands out.
    assert labels[0][2:] == [None, None] and labels[1] == [None] * 4
    assert scores["previous_token"][1].max() < 0.3


def test_synthetic_induction_heads_are_labelled():
    # No weights force an induction head simply (it needs a previous-token head feeding a
    # later layer's keys), so the patterns are made by hand: 8 uniform heads and one that
    # attends i -> i - L + 1 on the second copy.
    length = 5
    probe = repeated_probe(40, length=length, batch=2, first_token=1)
    size = 2 * length + 1
    induction = rows_to([0] * (length + 1) + [i - length + 1 for i in range(length + 1, size)])
    layer = np.broadcast_to(uniform(size), (2, 3, size, size)).copy()
    layers = [layer, layer.copy(), layer.copy()]
    layers[1][:, 2] = induction
    labels = dominant_type(type_scores_from_patterns(layers, probe))
    assert labels[1][2] == "induction"
    assert sum(label is not None for row in labels for label in row) == 1


# --- the labelling rule, by hand ------------------------------------------------------


def grid(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(2, 4)


def test_one_head_clearly_above_the_rest_is_labelled():
    previous = grid([0.9, 0.10, 0.12, 0.08, 0.11, 0.09, 0.10, 0.10])
    # Sorted .08 .09 .10 .10 .10 .11 .12 .9: median .10; deviations sorted
    # 0 0 0 .01 .01 .02 .02 .8: MAD .01; 3 * 1.4826 * .01 < .1 (the margin), and
    # .1 + .1 < .3 (the floor): threshold .3.
    low = grid([0.05] * 8)
    scores = {"previous_token": previous, "duplicate_token": low, "induction": low,
              "attention_sink": low}
    assert type_thresholds(scores)["previous_token"] == pytest.approx(0.3)
    assert dominant_type(scores) == [["previous_token", None, None, None], [None] * 4]


def test_a_wide_spread_raises_the_threshold_past_every_head():
    spread = grid([0.2, 0.4, 0.6, 0.8, 0.3, 0.5, 0.7, 0.95])
    # Median (.5 + .6) / 2 = .55; deviations .35 .15 .05 .25 .25 .05 .15 .4, sorted
    # .05 .05 .15 .15 .25 .25 .35 .4: MAD (.15 + .25) / 2 = .2.
    scores = {"previous_token": spread}
    assert type_thresholds(scores)["previous_token"] == pytest.approx(0.55 + 3 * 1.4826 * 0.2)
    assert dominant_type(scores) == [[None] * 4] * 2


def test_equal_heads_and_heads_near_zero_are_not_labelled():
    assert dominant_type({name: grid([0.5] * 8) for name in HEAD_TYPES}) == [[None] * 4] * 2
    # A hair above alike heads: MAD 0, but the margin puts the threshold at .5 + .1.
    hair = grid([0.55, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert type_thresholds({"induction": hair})["induction"] == pytest.approx(0.6)
    assert dominant_type({"induction": hair}) == [[None] * 4] * 2
    # One head stands out from heads at ~0 but stays under the floor.
    faint = grid([0.25, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01])
    assert type_thresholds({"induction": faint})["induction"] == DOMINANT_FLOOR
    assert dominant_type({"induction": faint}) == [[None] * 4] * 2


def test_several_types_take_the_largest_score_over_threshold_and_ties_are_none():
    scores = {
        # median .1, MAD 0: threshold .3. Head 0: 0.9 / .3 = 3; head 1: .6 / .3 = 2.
        "previous_token": grid([0.9, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]),
        # median 0: threshold .3. Head 1: .6 / .3 = 2, a tie with previous_token.
        "duplicate_token": grid([0.0, 0.6, 0, 0, 0, 0, 0, 0]),
        # median .5, MAD 0: threshold .5 + .1 = .6. Head 0: .95 / .6 = 1.58 < 3.
        # Head 3: .7 / .6 = 1.17, its only type.
        "induction": grid([0.95, 0.5, 0.5, 0.7, 0.5, 0.5, 0.5, 0.5]),
        # Head 4 stands out on attention to the first token, which labels no head.
        "attention_sink": grid([0.5, 0.5, 0.5, 0.5, 0.99, 0.5, 0.5, 0.5]),
    }
    assert dominant_type(scores) == [["previous_token", None, None, "induction"],
                                     [None] * 4]
    assert "attention_sink" not in type_thresholds(scores)
    scores["induction"] = grid([np.nan] * 8)  # never measured: never a label, never an error
    assert dominant_type(scores) == [["previous_token", None, None, None], [None] * 4]


def test_a_label_must_clear_the_threshold_by_the_probes_own_error():
    """A 4-row probe labelled heads that a larger one put below the threshold.
    A head is labelled only where its score clears the threshold by LABEL_MARGIN (3)
    standard errors; within that of it, it is borderline, either side."""
    assert LABEL_MARGIN == 3.0
    previous = grid([0.9, 0.33, 0.29, 0.1, 0.1, 0.1, 0.1, 0.1])
    # Sorted .1 x5 .29 .33 .9: median .1, MAD 0: threshold max(.1 + .1, .3) = .3.
    errors = {"previous_token": grid([0.01, 0.02, 0.01, 0.001, 0.001, 0.001, 0.001, 0.001])}
    scores = {"previous_token": previous}
    # Head 0: .9 - 3 x .01 > .3, labelled. Head 1: .33 - 3 x .02 = .27, not clear of .3:
    # borderline (|.33 - .3| <= .06), as is head 2 below it (|.29 - .3| <= .03). The
    # rest are .2 below, far beyond 3 x .001.
    assert dominant_type(scores, errors=errors) == [["previous_token", None, None, None],
                                                    [None] * 4]
    assert borderline(scores, errors) == [[[], ["previous_token"], ["previous_token"], []],
                                          [[]] * 4]
    # Without errors (a score with no sampling error) the plain rule: head 1 is labelled.
    assert dominant_type(scores) == [["previous_token", "previous_token", None, None],
                                     [None] * 4]


def test_the_probes_standard_error_is_the_spread_of_its_rows():
    model = forced_gpt2()
    probe = repeated_probe(64, length=7, batch=5, seed=3, first_token=1)
    scores, errors = probe_type_scores(model, probe, batch_size=2)
    # Independently: each row scored alone, then their mean and standard error.
    rows = [head_type_scores(model, probe[r:r + 1]) for r in range(5)]
    for name in HEAD_TYPES:
        each = np.stack([row[name] for row in rows])
        np.testing.assert_allclose(scores[name], each.mean(axis=0), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(errors[name], each.std(axis=0, ddof=1) / np.sqrt(5),
                                   rtol=1e-9, atol=1e-12)
    assert np.isnan(probe_type_scores(model, probe[:1])[1]["induction"]).all()


# --- the embedded model ------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_has_induction_heads_on_the_probe(embedded_lm):
    model = embedded_lm.model  # transformers' model of the GGUF file, float32
    probe = repeated_probe(model.config.vocab_size, length=24, batch=2,
                           first_token=model.config.bos_token_id)
    scores = head_type_scores(model, probe)
    induction = scores["induction"]
    heads = induction.shape[1]
    flat = induction.ravel()
    top = [(f"L{i // heads}H{i % heads}", round(float(flat[i]), 3))
           for i in np.argsort(-flat)[:5]]
    median = float(np.median(flat))
    message = f"top-5 induction heads {top}, median {median:.3f}"
    assert induction.shape == (30, 9), message
    assert flat.max() > 0.5 and flat.max() > median + 0.4, message
    labels = dominant_type(scores)
    assert any(label == "induction" for row in labels for label in row), message
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_smollm2_labels_hold_across_probe_seeds(embedded_lm, monkeypatch):
    """On the 4-row probe, labels moved with the probe's seed (on a 20-row probe
    7 of 33 fell below the threshold). With the default probe, no head labelled with a type
    by one seed is clearly not of it by another: where a seed labels it, every other seed
    labels it too or says it is too near that threshold to tell (borderline)."""
    import importlib

    # The module that holds the probe and computes types.json's content.
    types_module = importlib.import_module("lm_eval_headloc.method.head_types")
    lm = embedded_lm
    seeds = (0, 1, 2)
    runs = []
    for seed in seeds:
        monkeypatch.setattr(types_module, "PROBE", {**types_module.PROBE, "seed": seed})
        runs.append(types_module.head_types_of(lm))
    found = []
    for i, run in enumerate(runs):
        for layer, row in enumerate(run["dominant"]):
            for head, label in enumerate(row):
                if label is None:
                    continue
                name = f"L{layer}H{head}"
                found.append((seeds[i], name, label))
                for other in runs:
                    near = (other.get("borderline") or {}).get(name, [])
                    assert other["dominant"][layer][head] == label or label in near, (
                        f"seed {seeds[i]} labels {name} {label}; another seed: "
                        f"{other['dominant'][layer][head]}, borderline {near}, scores "
                        f"{[r['scores'][label][layer][head] for r in runs]}")
    labels = {(name, label) for _, name, label in found}
    # The embedded model's induction circuit (README): its strongest previous-token and
    # induction heads, labelled by every seed.
    assert {("L16H0", "previous_token"), ("L18H6", "induction")} <= labels
    assert all(label != "attention_sink" for _, _, label in found)
    assert runs[0]["probe"]["batch"] >= 32  # the default probe, not the 4 rows of before


def test_the_types_summary_counts_the_heads_that_stand_out():
    """'1 head(s) stand out': one head stands out, two heads stand out, none: 0 heads."""
    from lm_eval_headloc.method.head_types import HEAD_TYPES, HeadTypes
    from lm_eval_headloc.report.type_pages import types_summary

    scores = {t: [[0.9, 0.8, 0.1]] for t in HEAD_TYPES}
    dominant = [["previous_token", "previous_token", "induction"]]
    head_types = HeadTypes({"scores": scores, "dominant": dominant,
                            "thresholds": {t: 0.5 for t in HEAD_TYPES}})
    said = types_summary(head_types)
    assert "  previous-token: 2 heads stand out (threshold 0.50)" in said
    assert "  induction: 1 head stands out (threshold 0.50)" in said
    assert "  duplicate-token: 0 heads stand out (threshold 0.50)" in said
    # Attention to the first position labels no head, and is not said to be what this
    # model's typical head does where its median head barely does it.
    sink = {**{t: [[0.9, 0.8, 0.1]] for t in HEAD_TYPES}, "attention_sink": [[0.1, 0.06, 0.02]]}
    said = types_summary(HeadTypes({"scores": sink, "dominant": dominant,
                                    "thresholds": {t: 0.5 for t in HEAD_TYPES[:3]}}))
    assert ("  attention-sink: labels no head (in most language models the typical head does "
            "it; median here 0.06); highest L0H0 0.10, L0H1 0.06, L0H2 0.02") in said


def test_a_heads_types_are_read_by_its_name_and_a_neurons_are_refused():
    """of(*neuron) read L1N1's types as L1H1's: a Neuron unpacks to the same two numbers.
    One component is taken whole now, and a neuron is refused."""
    from helpers import raises_naming

    from lm_eval_headloc.intervention.components import ComponentSpecError, Head, Neuron
    from lm_eval_headloc.method.head_types import HEAD_TYPES, HeadTypes

    scores = {t: [[0.1, 0.2], [0.3, 0.4 + i]] for i, t in enumerate(HEAD_TYPES)}
    types = HeadTypes({"scores": scores, "dominant": [[None, None], [None, "induction"]],
                       "borderline": {"L1H1": ["previous_token"]}})
    assert types.of(Head(1, 1)) == types.of("L1H1") == types.of(1, 1) == {
        t: 0.4 + i for i, t in enumerate(HEAD_TYPES)}
    assert types.label("L1H1") == "induction" and types.borderline(Head(1, 1)) == [
        "previous_token"]
    for neuron in (Neuron(1, 1), "L1N1"):
        with raises_naming(ComponentSpecError, "L1N1", "MLP neuron"):
            types.of(neuron)
    with raises_naming(ComponentSpecError, "L1H0+L1H1", "one head"):
        types.label("L1H0+L1H1")
    with raises_naming(ComponentSpecError, "L2H0"):
        types.of("L2H0")
