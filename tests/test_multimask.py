"""Several masks per forward pass give the same answers and scores as one at a time, and
the scored-positions path gives HFLM's own answers."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHITECTURES,
    MASKS,
    TASKS,
    Request,
    load_lm,
    open_measurement,
    raises_naming,
)

from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.intervention.multimask import (
    RecordingLM,
    logits_only_at,
    loglikelihoods_for_masks,
)
from lm_eval_headloc.measurement.sizing import masks_per_pass_for_memory


@pytest.fixture(scope="module")
def measurement(tiny_model_dir, task_manager):
    return open_measurement(task_manager, load_lm(tiny_model_dir("qwen2")),
                            ["tiny_copy_ppl", "tiny_choice"])


@pytest.fixture(scope="module")
def requests(measurement):
    recorder = RecordingLM(measurement.lm)
    measurement.evaluate([], model=recorder)
    return recorder.requests


def test_answers_equal_hflm_one_mask_at_a_time(measurement, requests):
    lm = measurement.lm
    assert len(requests) == 4 * 2 + 10  # tiny_choice: 4 docs x 2 choices; tiny_copy: 10
    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    together = loglikelihoods_for_masks(lm, requests, masks, batch_size=8)
    assert_answers_are_hflms(lm, requests, masks, together)


def assert_answers_are_hflms(lm, requests, masks, together):
    """Each mask's answers equal HFLM's own loglikelihood with that mask set."""
    for heads, answers in zip(masks, together, strict=True):
        lm.set_heads(heads)
        alone = lm.loglikelihood([Request(r) for r in requests], disable_tqdm=True)
        for request, (logprob, greedy) in zip(requests, alone, strict=True):
            assert answers[request][0] == pytest.approx(logprob, abs=1e-4)
            assert answers[request][1] == greedy
    lm.set_heads([])


# (model dtype, HFLM softmax_dtype): HFLM takes the log-softmax in softmax_dtype, or in
# the logits' dtype when none is given. A float32 log-softmax (what the scored path once
# did) is off by ~1e-7 relative from a float64 one, and gives sums that bfloat16 cannot
# hold where HFLM's sum is a bfloat16.
SOFTMAX_CASES = [("float64", None), ("bfloat16", None), ("float32", "bfloat16")]


@pytest.mark.parametrize(("dtype", "softmax_dtype"), SOFTMAX_CASES)
def test_answers_use_hflms_softmax_dtype(tiny_model_dir, requests, dtype, softmax_dtype):
    extra = {"softmax_dtype": softmax_dtype} if softmax_dtype else {}
    lm = load_lm(tiny_model_dir("qwen2"), dtype=dtype, **extra)
    masks = [[], parse_heads("L0H0+L1H3", 2, 4)]
    together = loglikelihoods_for_masks(lm, requests, masks, batch_size=8)
    for heads, answers in zip(masks, together, strict=True):
        lm.set_heads(heads)
        alone = lm.loglikelihood([Request(r) for r in requests], disable_tqdm=True)
        for request, (logprob, greedy) in zip(requests, alone, strict=True):
            ours = answers[request][0]
            if dtype == "float64":
                assert ours == pytest.approx(logprob, rel=1e-12, abs=1e-12)
            else:  # a bfloat16 sum, within one bfloat16 step of HFLM's (lm_head on the
                # scored positions alone may round differently)
                assert torch.tensor(ours).to(torch.bfloat16).item() == ours
                assert ours == pytest.approx(logprob, rel=2**-7)
            assert answers[request][1] == greedy
    lm.set_heads([])


@pytest.mark.parametrize("per_pass", [1, 2, 4, 6])
def test_scores_equal_the_model_answering_lm_eval_itself(measurement, per_pass):
    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    one_by_one = [measurement.measure_with_model(heads) for heads in masks]
    batched = measurement.measure_many(masks, masks_per_pass=per_pass)
    for alone, together in zip(one_by_one, batched, strict=True):
        for task in alone:
            assert together[task].value == pytest.approx(alone[task].value, rel=1e-5)
    # The masks matter (the comparison could fail): some score moves off the baseline.
    values = [tuple(s[t].value for t in sorted(s)) for s in one_by_one]
    assert any(v != values[1] for v in values)  # MASKS[1] knocks out nothing


def test_locate_with_masks_per_pass_equals_one_at_a_time(tiny_model_dir, tmp_path):
    import json

    from lm_eval_headloc.cli.main import main

    args = ["locate", "--model-args", f"pretrained={tiny_model_dir('llama')},dtype=float32",
            "--include-path", TASKS, "--tasks", "tiny_copy_ppl", "--masks", "9",
            "--sparsity", "0.25", "--num-samples", "6", "--batch-size", "4"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--masks-per-pass", "4", "--out", str(tmp_path / "four")]) == 0
    one, four = ([json.loads(x) for x in (tmp_path / d / "measurements.jsonl").read_text()
                  .splitlines()] for d in ("one", "four"))
    assert [r["mask"] for r in one] == [r["mask"] for r in four]
    for a, b in zip(one, four, strict=True):
        assert b["scores"]["tiny_copy_ppl"] == pytest.approx(a["scores"]["tiny_copy_ppl"],
                                                             rel=1e-5)


def test_greedy_with_masks_per_pass_equals_one_at_a_time(tiny_model_dir, tmp_path):
    import json

    from lm_eval_headloc.cli.main import main

    args = ["greedy", "--model-args", f"pretrained={tiny_model_dir('gpt2')},dtype=float32",
            "--include-path", TASKS, "--tasks", "tiny_copy", "--num-samples", "6",
            "--batch-size", "4", "--top-k", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--masks-per-pass", "3", "--out", str(tmp_path / "three")]) == 0
    one, three = ([json.loads(x) for x in (tmp_path / d / "measurements.jsonl").read_text()
                   .splitlines()] for d in ("one", "three"))
    assert len(one) == len(three) == 1 + 8
    for a, b in zip(one, three, strict=True):
        assert b["mask"] == a["mask"]
        assert b["scores"]["tiny_copy"] == pytest.approx(a["scores"]["tiny_copy"], rel=1e-5)


def test_each_task_subset_ignores_the_other_tasks():
    from lm_eval_headloc.measurement.harness import choose_subset

    alone = choose_subset({"b": 50}, 10, 0)["b"]
    assert choose_subset({"a": 50, "b": 50}, 10, 0)["b"] == alone
    assert choose_subset({"b": 50}, 10, 1)["b"] != alone


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_logits_only_at_scored_positions_equal_full_logits(tiny_model_dir, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    model.eval()
    batch = torch.randint(3, 300, (3, 7))
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    positions = torch.tensor([5, 6, 0, 2, 3, 6])
    with torch.no_grad():
        full = model(batch).logits
        with logits_only_at(model, rows, positions):
            narrow = model(batch).logits
    assert narrow.shape == (1, len(rows), full.shape[-1])  # only the scored positions
    torch.testing.assert_close(narrow[0], full[rows, positions], rtol=1e-5, atol=1e-5)


class OnOtherDevice(torch.Tensor):
    """An index tensor on another device than the tensor it indexes (as the batch on
    cuda:0 and lm_head's input on cuda:1 under parallelize=True): indexing with it fails
    as torch fails then, until ``.to(device)`` moves it there (a plain tensor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].to(*args[1:], **kwargs).as_subclass(torch.Tensor)
        if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple) and any(
                isinstance(index, cls) for index in args[1]):
            raise RuntimeError("indices should be either on cpu or on the same device as "
                               "the indexed tensor")
        return super().__torch_function__(func, types, args, kwargs)


def test_logits_only_at_follows_the_hidden_states_device(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    batch = torch.randint(3, 300, (2, 5))
    rows, positions = torch.tensor([0, 1, 1]), torch.tensor([4, 2, 3])
    with torch.no_grad():
        full = model(batch).logits
        with logits_only_at(model, rows.as_subclass(OnOtherDevice),
                            positions.as_subclass(OnOtherDevice)):
            narrow = model(batch).logits
    torch.testing.assert_close(narrow[0], full[rows, positions], rtol=1e-5, atol=1e-5)


def _llama_config(hidden, ffn, layers, heads, kv_heads, vocab):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       vocab_size=vocab)


SMOLLM2 = dict(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, vocab=49152)
LLAMA3_8B = dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256)
GIB = 2**30


def test_masks_per_pass_for_memory_by_hand():
    # SmolLM2-135M in bfloat16, the widest batch BENCH.md records for headloc_induction:
    # 32 rows x 26 tokens, one scored token per row. Per mask copy, in bytes:
    #   activations  832 tokens x (6 x 576 + 3 x 1536) x 2    = 13_418_496
    #   K/V cache    832 x 30 layers x 2 x 3 x 64 x 2         = 19_169_280
    #   attention    32 rows x 9 heads x 26 x 26 x 2          =    389_376
    #   logits       32 scored x 49152 x (2 + 8)              = 15_728_640
    #   total                                                  = 48_705_792
    smollm2 = _llama_config(**SMOLLM2)
    shapes = [(32, 26, 32), (32, 20, 32), (4, 14, 4)]
    assert masks_per_pass_for_memory(2 * 48_705_792 * 7, shapes, smollm2, 2) == 7
    assert masks_per_pass_for_memory(2 * 48_705_792 * 7 - 1, shapes, smollm2, 2) == 6
    # An 80 GB GPU holds the 64-mask cap (sizing rows by max_length gave 1-2).
    assert masks_per_pass_for_memory(70 * GIB, shapes, smollm2, 2) == 64


def test_a_hybrid_keeps_a_key_value_cache_in_its_attention_layers_only():
    # A Qwen3.5-like model: 4 layers, attention in 1 and 3, the rest Gated DeltaNet.
    # 32 rows x 26 tokens, 32 scored, bfloat16. Per mask copy, in bytes:
    #   activations  832 x (6 x 256 + 3 x 512) x 2           =  5_111_808
    #   K/V cache    832 x 2 attention layers x 2 x 2 x 64 x 2 =    851_968
    #   states       32 rows x 2 other layers x 2 x 256 x 128 x 2 = 8_388_608
    #   attention    32 x 4 heads x 26 x 26 x 2                =    173_056
    #   logits       32 x 1000 x (2 + 8)                       =    320_000
    #   total                                                  = 14_845_440
    from transformers import Qwen3_5TextConfig

    hybrid = Qwen3_5TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000,
        layer_types=["linear_attention", "full_attention"] * 2)
    shapes = [(32, 26, 32)]
    assert masks_per_pass_for_memory(2 * 14_845_440 * 5, shapes, hybrid, 2) == 5
    assert masks_per_pass_for_memory(2 * 14_845_440 * 5 - 1, shapes, hybrid, 2) == 4


def test_masks_per_pass_grow_with_free_memory_and_shrink_with_the_batch_and_model():
    small, large = _llama_config(**SMOLLM2), _llama_config(**LLAMA3_8B)
    shapes = [(32, 512, 64)]  # about 0.8 GB per mask for the small model
    assert masks_per_pass_for_memory(0, shapes, small) == 1  # never zero
    assert masks_per_pass_for_memory(1000 * GIB, shapes, small) == 64  # capped
    few, many = (masks_per_pass_for_memory(m * GIB, shapes, small) for m in (8, 64))
    assert 1 < few < many < 64
    assert masks_per_pass_for_memory(64 * GIB, shapes, large) < many
    assert masks_per_pass_for_memory(64 * GIB, [(32, 1024, 64)], small) < many  # wider
    assert masks_per_pass_for_memory(64 * GIB, [(64, 512, 128)], small) < many  # more rows
    # Only the largest batch counts.
    assert masks_per_pass_for_memory(64 * GIB, [*shapes, (4, 16, 4)], small) == many


def test_seq2seq_models_answer_through_hflm(measurement, monkeypatch):
    import lm_eval_headloc.intervention.multimask as multimask

    def refuse(*args, **kwargs):
        raise AssertionError("multimask builds decoder-only inputs")

    monkeypatch.setattr(multimask, "loglikelihoods_for_masks", refuse)
    monkeypatch.setattr(measurement, "measure_with_model", lambda heads: {"hflm": heads})
    monkeypatch.setattr(measurement.lm, "backend", "seq2seq")
    masks = [parse_heads("L0H1", 2, 4), []]
    assert measurement.measure_many(masks, masks_per_pass=2) == [{"hflm": m} for m in masks]
    monkeypatch.setattr(measurement.lm, "backend", "causal")
    with pytest.raises(AssertionError, match="decoder-only"):
        measurement.measure_many(masks, masks_per_pass=2)


def test_requests_are_tokenized_once_per_measurement_run(measurement, monkeypatch):
    masks = [parse_heads("L0H1", 2, 4), []]
    measurement.measure_many(masks)  # records and tokenizes on first use
    calls = []
    encode = measurement.lm._encode_pair
    monkeypatch.setattr(measurement.lm, "_encode_pair",
                        lambda *args: calls.append(args) or encode(*args))
    again = measurement.measure_many(masks, masks_per_pass=2)
    assert calls == []
    monkeypatch.undo()  # HFLM's own path below tokenizes, as it should
    for heads, scores in zip(masks, again, strict=True):
        expected = measurement.measure_with_model(heads)
        for task in expected:
            assert scores[task].value == pytest.approx(expected[task].value, rel=1e-5)


def test_masks_per_pass_must_be_a_positive_whole_number(measurement):
    from lm_eval_headloc.common.checks import UsageError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="masks_per_pass"):
            measurement.measure_many([[]], masks_per_pass=bad)


def test_requests_are_encoded_by_lm_eval_and_inputs_checked_against_hflm(tiny_model_dir,
                                                                         monkeypatch):
    from lm_eval.api.instance import Instance

    from lm_eval_headloc.intervention import multimask

    lm = load_lm(tiny_model_dir("llama"), max_length=16)  # short: truncation is exercised
    keys = [("", "the cat"), ("The cat sat on the mat and the dog came in and", " slept")]
    pairs = multimask.encoded(lm, keys)
    assert pairs[0][0] == [lm.prefix_token_id]  # lm-eval's empty-context rule
    assert pairs[1][0] + pairs[1][1] == lm.tok_encode(keys[1][0] + keys[1][1])
    requests = multimask.LoglikelihoodRequests(lm, keys)  # checks its inputs: passes
    assert len(pairs[1][0] + pairs[1][1]) > 17  # so the input is cut
    assert max(width for _, width, _ in requests.shapes(4)) == 16
    # Answers under truncation equal HFLM's own.
    ours = loglikelihoods_for_masks(lm, requests, [[]])[0]
    theirs = lm.loglikelihood([Instance("loglikelihood", doc={}, arguments=k, idx=0)
                               for k in keys], disable_tqdm=True)
    for key, (logprob, greedy) in zip(keys, theirs, strict=True):
        assert ours[key][0] == pytest.approx(logprob, abs=1e-5)
        assert ours[key][1] == greedy
    # A rule that differs from HFLM's (no left truncation) is refused in one line.
    monkeypatch.setattr(multimask, "model_input", lambda c, x, _: (c + x)[:-1])
    with raises_naming(RuntimeError, "lm-eval==0.4.13") as info:
        multimask.LoglikelihoodRequests(lm, keys)
    assert "\n" not in str(info.value)


def test_example_parts_are_disjoint_and_cover_the_documents():
    from lm_eval_headloc.measurement.harness import choose_subset

    first = choose_subset({"a": 51}, None, 4, (1, 2))["a"]
    second = choose_subset({"a": 51}, None, 4, (2, 2))["a"]
    assert not set(first) & set(second) and sorted(first + second) == list(range(51))
    assert {len(first), len(second)} == {25, 26}
    # --num-samples takes that many from the part; another seed cuts differently.
    assert set(choose_subset({"a": 51}, 10, 4, (1, 2))["a"]) <= set(first)
    assert choose_subset({"a": 51}, None, 5, (1, 2))["a"] != first
    # Without a part, the subset is what it always was.
    assert choose_subset({"a": 51}, 10, 4) == choose_subset({"a": 51}, 10, 4, None)


@pytest.mark.parametrize("continuation", [" slept", " slept on the mat"])
def test_a_single_request_passes_the_input_check_and_is_answered_as_hflm_does(
        tiny_model_dir, continuation):
    """One request (a subset of one document), or only identical ones: the narrowest and
    widest request are the same, which HFLM answers with one row; the check used to
    expect two and refuse every such measurement."""
    from lm_eval.api.instance import Instance

    from lm_eval_headloc.intervention import multimask

    lm = load_lm(tiny_model_dir("llama"))
    key = ("The cat sat on the mat and the dog", continuation)
    requests = multimask.LoglikelihoodRequests(lm, [key, key])  # raised before the fix
    ours = loglikelihoods_for_masks(lm, requests, [[]])[0]
    theirs = lm.loglikelihood([Instance("loglikelihood", doc={}, arguments=key, idx=0)],
                              disable_tqdm=True)[0]
    assert ours[key][0] == pytest.approx(theirs[0], abs=1e-5)
    assert ours[key][1] == theirs[1]


def test_requests_with_the_same_model_input_share_one_row(measurement):
    """An MMLU-style question's one-token choices all feed the model the question alone:
    one row answers them all (HFLM groups them too), and the answers stay HFLM's."""
    from lm_eval_headloc.intervention.multimask import LoglikelihoodRequests

    lm = measurement.lm
    questions = ["The capital of France is", "Two plus two makes"]
    letters = ["A", "B", "C", "D"]  # single bytes: one token each in the tiny tokenizer
    assert all(len(lm.tok_encode(letter)) == 1 for letter in letters)
    longer = " a much longer answer"
    assert len(lm.tok_encode(longer)) > 1
    requests = [(q, letter) for q in questions for letter in letters] + [(questions[0], longer)]
    shared = LoglikelihoodRequests(lm, requests)
    (batch,) = shared.batches(32)
    # Two questions, four one-token letters each: two rows; the longer answer reads more.
    assert len(batch.input_ids) == 3 and len(batch.keys) == len(requests)
    assert sorted(batch.keys) == sorted(requests)
    masks = [[], parse_heads("L0H1+L1H2", 2, 4)]
    assert_answers_are_hflms(lm, requests, masks, loglikelihoods_for_masks(lm, shared, masks))
    # One row per distinct input counts against the batch size: two passes of one row
    # here, then one with the longer answer's row.
    assert [len(b.input_ids) for b in shared.batches(1)] == [1, 1, 1]


def test_a_pass_that_runs_out_of_gpu_memory_is_retried_at_half_the_masks(
        measurement, monkeypatch, caplog):
    """The automatic masks per pass is an estimate from free memory; a pass that does not
    fit halves K for the rest of the run instead of ending it, with the same scores."""
    from lm_eval_headloc.intervention import multimask

    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    # The passes the retry makes, run directly: float32 sums of other batch shapes (one mask
    # per pass) may differ in their last bits (they do under transformers 5.24's kernels).
    expected = measurement.measure_many(masks, masks_per_pass=3)
    real = multimask.loglikelihoods_for_masks
    tried = []

    def three_fit(lm, requests, group, batch_size=32):
        tried.append(len(group))
        if len(group) > 3:
            # cuBLAS says it in a plain RuntimeError (torch.OutOfMemoryError: below).
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                               "cublasCreate(handle)")
        return real(lm, requests, group, batch_size)

    monkeypatch.setattr(multimask, "loglikelihoods_for_masks", three_fit)
    with caplog.at_level("WARNING", logger="lm_eval_headloc.measurement.measure"):
        got = measurement.measure_many(masks, masks_per_pass=6)
    assert tried == [6, 3, 3]  # 6 failed; the six masks in passes of three
    assert measurement.most_masks_per_pass == 3
    assert "6 masks per pass ran out of GPU memory; measuring 3" in caplog.text
    assert got == expected
    tried.clear()
    measurement.measure_many(masks[:4], masks_per_pass=4)  # stays halved: nothing fails
    assert tried == [3, 1]
    measurement.most_masks_per_pass = None
    # One mask that does not fit is not hidden, nor an error that is not about memory.
    for error, per_pass in ((torch.OutOfMemoryError("CUDA out of memory"), 1),
                            (RuntimeError("shape mismatch"), 4)):
        monkeypatch.setattr(multimask, "loglikelihoods_for_masks", lambda *a, e=error, **k: (
            _ for _ in ()).throw(e))
        with pytest.raises(RuntimeError, match=str(error)):
            measurement.measure_many(masks[:4], masks_per_pass=per_pass)
        assert measurement.most_masks_per_pass is None


def test_a_subset_of_one_question_with_letter_choices_passes_the_input_check(measurement):
    """Its narrowest and widest requests are two letters of one question: HFLM sends
    one row for them, which the check must expect (it refused the subset)."""
    from lm_eval_headloc.intervention.multimask import LoglikelihoodRequests

    lm = measurement.lm
    requests = [("Two plus two makes", letter) for letter in "ABCD"]
    shared = LoglikelihoodRequests(lm, requests)
    assert [len(b.input_ids) for b in shared.batches(8)] == [1]
    assert_answers_are_hflms(lm, requests, [[]], loglikelihoods_for_masks(lm, shared, [[]]))


def test_a_continuation_hflm_would_not_score_is_refused(measurement):
    from lm_eval_headloc.intervention.multimask import LoglikelihoodRequests

    lm = measurement.lm
    too_long = " word" * (int(lm.max_length) + 1)
    for bad in (("a question", ""), ("a question", too_long)):
        requests = [("one question here", " an answer"), bad, ("short", " x")]
        with raises_naming(ValueError, repr(bad), f"max_length ({int(lm.max_length)})"):
            LoglikelihoodRequests(lm, requests)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_per_row_masks_placed_without_waiting_answer_as_hflm(tiny_model_dir,
                                                                     task_manager):
    """On CUDA the per-row masks reach the GPU by a copy that does not make the host wait
    (hooks._to_device_without_waiting): the answers are still HFLM's, mask by mask."""
    lm = load_lm(tiny_model_dir("qwen2"), device="cuda")
    gpu = open_measurement(task_manager, lm, ["tiny_copy_ppl", "tiny_choice"])
    recorder = RecordingLM(lm)
    gpu.evaluate([], model=recorder)
    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    together = loglikelihoods_for_masks(lm, recorder.requests, masks, batch_size=8)
    assert_answers_are_hflms(lm, recorder.requests, masks, together)
