"""Several masks per ``generate`` call give every mask exactly the answers of lm-eval's own
``generate_until`` with that mask alone, and rows stop on their own (``multigen``)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHITECTURES,
    GENERATION_MASKS,
    GENERATION_TASK,
    lm_evals_own,
    load_lm,
    open_generation_measurement,
    with_stops_that_end_rows,
)

import lm_eval_headloc.intervention.multigen as multigen
from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.measurement.sizing import (
    CPU_GENERATION_ROWS,
    CPU_MEMORY_SHARE,
    GENERATION_MEMORY_SHARE,
    generation_masks_for_memory,
)


def made_criteria(monkeypatch):
    """Every ``RowStops`` made from now on, in a list."""
    made = []
    real = multigen.RowStops.__init__

    def remember(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(multigen.RowStops, "__init__", remember)
    return made


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_each_mask_gets_lm_evals_own_answers(tiny_model_dir, task_manager, family,
                                             monkeypatch):
    lm = load_lm(tiny_model_dir(family))
    instances = with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch)
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    made = made_criteria(monkeypatch)
    together = multigen.generations_for_masks(lm, instances, masks, rows=5)
    # The test means something: three batches of 5 x 5 rows (12 requests), rows ending at
    # different steps and some not before max_gen_toks, masks that answer differently.
    assert [len(c.finished_at) for c in made] == [25, 25, 10]
    ends = [end for c in made for end in c.finished_at]
    assert len({end for end in ends if end is not None}) > 2, ends
    assert len({tuple(answers) for answers in together}) > 1
    for heads, answers in zip(masks, together, strict=True):
        assert answers == lm_evals_own(lm, instances, heads, 5, monkeypatch), heads


def test_a_hybrid_model_keeps_each_rows_mask_through_its_recurrent_layers(
        tiny_hybrid_dir, task_manager, monkeypatch):
    lm = load_lm(tiny_hybrid_dir)
    instances = with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch)
    masks = [[], parse_heads("L1H0+L3H2", 4, 4), parse_heads("L3H*", 4, 4)]
    together = multigen.generations_for_masks(lm, instances, masks, rows=4)
    for heads, answers in zip(masks, together, strict=True):
        assert answers == lm_evals_own(lm, instances, heads, 4, monkeypatch), heads


def count_steps(lm) -> list[int]:
    """Forward passes of ``lm``'s model from now on, in a one-element list."""
    steps = [0]

    def count(*_):
        steps[0] += 1

    lm.model.register_forward_pre_hook(count)
    return steps


def test_rows_stop_on_their_own_and_the_batch_ends_with_its_last(tiny_model_dir,
                                                                 task_manager, monkeypatch):
    """lm-eval's criteria end a batch only when one stop string is in every row: rows that
    stopped on different strings generate on to max_gen_toks. Ours end each row, and the
    batch with its last, with the same answers."""
    lm = load_lm(tiny_model_dir("llama"))
    instances = with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch,
        every_row=True)
    made = made_criteria(monkeypatch)
    steps = count_steps(lm)
    lm.batch_size_per_gpu = len(instances)  # one batch
    ours = lm.generate_until(instances, disable_tqdm=True)
    (criteria,) = made
    assert None not in criteria.finished_at
    assert len(set(criteria.finished_at)) > 2  # rows end at different steps
    assert steps[0] == max(criteria.finished_at) - criteria.prompt_width < 12
    steps[0] = 0
    assert lm_evals_own(lm, instances, [], len(instances), monkeypatch) == ours
    assert steps[0] == 12  # no one stop string is in every row: to max_gen_toks


def test_rows_stop_on_their_own_without_replacing_lm_evals_criteria(tiny_model_dir,
                                                                   task_manager):
    """Our rows end on their own through our model's own ``generate`` call: lm-eval's
    ``stop_sequences_criteria`` stays lm-eval's for every other model in the process, and
    a plain ``hf`` model beside ours keeps lm-eval's batch-level stopping."""
    from lm_eval.models import huggingface

    lm = load_lm(tiny_model_dir("llama"))
    original = huggingface.stop_sequences_criteria
    seen = []
    lm.model.register_forward_pre_hook(
        lambda *_: seen.append(huggingface.stop_sequences_criteria is original))
    instances = open_generation_measurement(task_manager, lm).generating_instances()
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    with multigen.rows_stop_on_their_own(lm) as made:
        multigen.generations_for_masks(lm, instances, masks, rows=6)
        plain = huggingface.stop_sequences_criteria(lm.tokenizer, ["\n"], 3, 2)
    assert seen and all(seen)
    assert made and all(isinstance(c, multigen.RowStops) for c in made)
    assert not any(isinstance(c, multigen.RowStops) for c in plain)
    assert lm.row_stops is None and not multigen.stopping_per_row(lm)


def ending_rows_early(lm):
    """``lm``'s model, generating greedily, ends many rows on its end-of-sequence token."""
    from collections import Counter

    ids, attention = lm.tok_batch_encode(["the cat sat on", "Mary and John went to",
                                          "one two three four", "when the dog"])
    generated = lm.model.generate(ids, attention_mask=attention, max_new_tokens=12,
                                  do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    common = Counter(generated.flatten().tolist()).most_common(1)[0][0]
    lm.model.generation_config.eos_token_id = common


def test_rows_ended_by_an_eos_token_answer_as_alone(tiny_model_dir, task_manager,
                                                    monkeypatch):
    lm = load_lm(tiny_model_dir("llama"))
    ending_rows_early(lm)
    instances = open_generation_measurement(task_manager, lm).generating_instances()
    made = made_criteria(monkeypatch)
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    together = multigen.generations_for_masks(lm, instances, masks, rows=6)
    assert together == [lm_evals_own(lm, instances, heads, 6, monkeypatch) for heads in masks]
    ends = [end for c in made for end in c.finished_at]
    assert len({end for end in ends if end is not None}) > 2


def test_a_pad_token_that_is_a_word_keeps_lm_evals_own_stopping(tiny_model_dir,
                                                                task_manager, monkeypatch):
    """lm-eval keeps a word-like pad token's text after a row's end-of-sequence token, as
    often as its batch ran on: such rows are not ended sooner, nor masks batched."""
    lm = load_lm(tiny_model_dir("llama"))
    ending_rows_early(lm)
    lm.tokenizer.pad_token = lm.tokenizer.convert_ids_to_tokens(260)  # not special
    padding = lm.tokenizer.decode([260]) * 2
    measure = open_generation_measurement(task_manager, lm)
    assert not multigen.stops_per_row(lm, {"do_sample": False})
    assert not measure.generates_together
    lm.batch_size_per_gpu = 6
    ours = lm.generate_until(measure.generating_instances(), disable_tqdm=True)
    stock = lm_evals_own(lm, measure.generating_instances(), [], 6, monkeypatch)
    assert ours == stock and any(padding in answer for answer in stock)


def test_sampled_or_thinking_generation_is_not_shared_nor_stopped_early(tiny_model_dir,
                                                                       task_manager):
    lm = load_lm(tiny_model_dir("llama"))
    greedy = open_generation_measurement(task_manager, lm).generating_instances()
    assert multigen.shares_generate(lm, greedy)
    for gen_kwargs in ({"do_sample": True, "temperature": 0.7}, {"num_beams": 2}):
        sampled = open_generation_measurement(task_manager, lm, gen_kwargs=gen_kwargs)
        assert not multigen.shares_generate(lm, sampled.generating_instances()), gen_kwargs
        assert not sampled.generates_together
    assert not multigen.stops_per_row(lm, {"do_sample": True})
    # do_sample unset with a temperature: the model's generation config decides.
    lm.model.generation_config.do_sample = True
    assert not multigen.stops_per_row(lm, {"temperature": 0.7})
    assert multigen.stops_per_row(lm, {"temperature": 0.0})
    lm.model.generation_config.do_sample = False
    assert multigen.stops_per_row(lm, {"temperature": 0.7})
    # A stop string before the end of thinking does not end the answer (lm-eval cuts
    # after think_end_token first).
    lm.think_end_token = "</think>"
    assert not multigen.stops_per_row(lm, {"do_sample": False})
    assert not multigen.shares_generate(lm, greedy)


def test_beams_of_the_models_generation_config_are_measured_one_mask_at_a_time(
        tiny_model_dir, task_manager):
    """A model whose generation config asks for beam search (a task that names no
    num_beams) generates with beams under lm-eval: its masks share no generate call (it
    failed: 'per-row masks for 60 rows, batch has 180')."""
    lm = load_lm(tiny_model_dir("llama"))
    lm.model.generation_config.num_beams = 3
    measure = open_generation_measurement(task_manager, lm)
    assert not multigen.shares_generate(lm, measure.generating_instances())
    masks = [[], parse_heads("L0H1", 2, 4)]
    assert measure.measure_many(masks, masks_per_pass=2) == \
        [measure.measure_with_model(heads) for heads in masks]


@pytest.mark.parametrize("tasks", [(GENERATION_TASK,), (GENERATION_TASK, "tiny_choice")],
                         ids=["generation", "generation and multiple choice"])
def test_a_measurement_of_k_masks_per_generate_scores_as_one_at_a_time(
        tiny_model_dir, task_manager, tasks, monkeypatch):
    lm = load_lm(tiny_model_dir("qwen2"))
    measure = open_generation_measurement(task_manager, lm, tasks)
    assert measure.generates_together and not measure.scored_positions
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    calls = []
    real = multigen.generations_for_masks
    monkeypatch.setattr(multigen, "generations_for_masks",
                        lambda lm, instances, group, rows: calls.append(len(group))
                        or real(lm, instances, group, rows))
    together = measure.measure_many(masks, masks_per_pass=3)
    assert calls == [3, 2]
    with monkeypatch.context() as patch:  # the live model answers, lm-eval's criteria
        patch.setattr(multigen, "stops_per_row", lambda *_: False)
        alone = [measure.measure_with_model(heads) for heads in masks]
    assert [{t: s.value for t, s in scores.items()} for scores in together] == \
        [{t: s.value for t, s in scores.items()} for scores in alone]
    assert len({scores[GENERATION_TASK].value for scores in alone}) > 1  # masks differ


def test_a_rolling_loglikelihood_task_beside_a_generation_task_is_measured_by_the_model(
        tiny_model_dir, task_manager):
    """multimask answers plain loglikelihoods only: with a perplexity task (rolling
    loglikelihoods) among the tasks, every mask goes through the live model, and each
    task's score is what the model's own evaluation gives (it used to fail: 'no documents
    recorded for tiny_rolling')."""
    lm = load_lm(tiny_model_dir("llama"))
    measure = open_generation_measurement(task_manager, lm, (GENERATION_TASK, "tiny_rolling"))
    kinds = {i.request_type for i in measure.recorded_instances()}
    assert kinds == {"generate_until", "loglikelihood_rolling"}
    assert not multigen.shares_generate(lm, measure.recorded_instances())
    assert not measure.generates_together
    masks = [[], parse_heads("L0H1", 2, 4)]
    together = measure.measure_many(masks, masks_per_pass=2)
    alone = [measure.measure_with_model(heads) for heads in masks]
    assert [{t: s.value for t, s in scores.items()} for scores in together] == \
        [{t: s.value for t, s in scores.items()} for scores in alone]


def test_sampled_generation_is_measured_one_mask_at_a_time(tiny_model_dir, task_manager,
                                                           monkeypatch):
    lm = load_lm(tiny_model_dir("llama"))
    measure = open_generation_measurement(task_manager, lm,
                               gen_kwargs={"do_sample": True, "temperature": 0.7})

    def refuse(*_):
        raise AssertionError("sampled requests must not share generate calls")

    monkeypatch.setattr(multigen, "generations_for_masks", refuse)
    scores = measure.measure_many([[], parse_heads("L0H1", 2, 4)], masks_per_pass=2)
    assert len(scores) == 2


def test_the_automatic_k_for_generation_counts_each_rows_key_value_cache():
    """Hand-computed for Llama-3.1-8B's shape (bfloat16): 32 layers x 8 key/value heads x
    128 values x 2 (keys and values) x 2 bytes = 131,072 bytes per token."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256)
    rows, prompt = 100, 258
    one_layer = 6 * 4096 + 3 * 14336  # activations per token (residual, q/k/v/o, MLP)
    logits = rows * 128256 * (2 + 8)  # the last position's, bfloat16 and float32 copies
    prompt_pass = (rows * prompt * 131_072 + rows * prompt * one_layer * 2
                   + rows * 32 * prompt * prompt * 2 + logits)
    for new, deciding in ((256, "prompt pass"), (770, "last step")):
        last_step = rows * (prompt + new) * 131_072 + rows * one_layer * 2 + rows * 32 * 2 \
            + logits
        per_copy = max(prompt_pass, last_step)
        assert deciding == ("prompt pass" if per_copy == prompt_pass else "last step")
        for free_gib in (20, 60, 124):
            free = free_gib * 2**30
            want = max(1, int(GENERATION_MEMORY_SHARE * free // per_copy))
            assert generation_masks_for_memory(free, rows, prompt, new, config) == want
    # 0.85 x 124 GiB over 7.42 GB (256 new tokens) and over 13.6 GB (770).
    assert generation_masks_for_memory(124 * 2**30, rows, prompt, 256, config) == 15
    assert generation_masks_for_memory(124 * 2**30, rows, prompt, 770, config) == 8


def test_a_generate_call_that_runs_out_of_gpu_memory_is_retried_at_half_the_masks(
        tiny_model_dir, task_manager, monkeypatch):
    lm = load_lm(tiny_model_dir("llama"))
    measure = open_generation_measurement(task_manager, lm)
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS[:4]]
    want = [s[GENERATION_TASK].value for s in measure.measure_many(masks, masks_per_pass=1)]
    real, tried = multigen.generations_for_masks, []

    def small_gpu(lm, instances, group, rows):
        tried.append(len(group))
        if len(group) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(lm, instances, group, rows)

    monkeypatch.setattr(multigen, "generations_for_masks", small_gpu)
    got = [s[GENERATION_TASK].value for s in measure.measure_many(masks, masks_per_pass=4)]
    assert tried == [4, 2, 2] and measure.most_masks_per_pass == 2
    assert got == want


@pytest.mark.slow
def test_the_embedded_model_rhymes_alike_four_masks_per_generate(smollm2, monkeypatch):
    from lm_eval_headloc.intervention.embedded import smollm2_model_args
    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.setup import prepare
    from lm_eval_headloc.runs.spec import RunSpec

    setup = prepare(RunSpec(tasks=("rhyme",), model_args=smollm2_model_args()))
    measure = open_measurement(setup, load_model(setup), num_samples=16)
    assert measure.generates_together
    masks = [[], parse_heads("L0H*", 30, 9), parse_heads("L3H1+L10H4+L20H0", 30, 9),
             parse_heads("L29H*+L28H*", 30, 9)]
    instances = measure.generating_instances()
    together = multigen.generations_for_masks(measure.lm, instances, masks,
                                              measure.rows_per_generate())
    for heads, answers in zip(masks, together, strict=True):
        assert answers == lm_evals_own(measure.lm, instances, heads,
                                       measure.rows_per_generate(), monkeypatch)
    assert len({tuple(a) for a in together}) > 1
    scores = measure.measure_many(masks, masks_per_pass=4)
    with monkeypatch.context() as patch:
        patch.setattr(multigen, "stops_per_row", lambda *_: False)
        assert [s["rhyme"].value for s in scores] == \
            [measure.measure_with_model(heads)["rhyme"].value for heads in masks]


def test_only_tokens_that_can_end_a_stop_string_are_looked_at(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    decoded = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    table = multigen.could_end(tokenizer, ("Question:", "at"), frozenset({2}))
    want = [":" in text or "t" in text or i == 2 for i, text in enumerate(decoded)]
    assert table.tolist() == want and 0 < sum(want) < len(want) / 2
    # A space or a non-ASCII last character may not stand alone in a token's decoding.
    for stops in ((" ",), ("cat ",), ("été",)):
        assert multigen.could_end(tokenizer, stops, frozenset()).all()


def generating_bytes_per_mask(lm, measure) -> int:
    """The memory one mask's copy of a generate call of the tiny Llama takes, as
    ``generation_masks_for_memory`` counts it, worked out by hand."""
    width = max(len(lm.tok_encode(i.args[0])) for i in measure.generating_instances())
    # Per mask copy of 4 rows of the tiny Llama (hidden 32, MLP 64, 2 layers, 4 heads, 2 K/V
    # heads of 8, vocab 300, float32), prompts `width` wide, 12 new tokens (the task's):
    # K/V cache 2*2*2*8*4 = 256 bytes a token; activations (6*32 + 3*64)*4 = 1536 a token.
    rows, logits = 4, 4 * 300 * (4 + 8)
    prompt_pass = rows * width * (256 + 1536) + rows * 4 * width * width * 4 + logits
    last_step = rows * (width + 12) * 256 + rows * (1536 + 4 * 4) + logits
    return max(prompt_pass, last_step)


def test_the_automatic_k_of_a_generation_measurement_on_a_cpu(tiny_model_dir, task_manager,
                                                              monkeypatch):
    from types import SimpleNamespace

    import psutil

    lm = load_lm(tiny_model_dir("llama"))  # batch size 4
    measure = open_generation_measurement(task_manager, lm)
    assert measure.rows_per_generate() == 4
    # Masks fill a call to CPU_GENERATION_ROWS rows; the run records the choice.
    assert measure.chosen_masks_per_pass is None
    assert measure.auto_masks_per_pass() == CPU_GENERATION_ROWS // 4 == 32
    assert measure.chosen_masks_per_pass == 32
    # Where the available memory holds fewer copies (at CPU_MEMORY_SHARE), that many.
    per_copy = generating_bytes_per_mask(lm, measure)
    available = int(3.5 * per_copy / CPU_MEMORY_SHARE)
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=available))
    assert measure.auto_masks_per_pass() == 3


def test_the_automatic_k_of_a_generation_measurement_on_a_gpu(tiny_model_dir, task_manager,
                                                              monkeypatch):
    from lm_eval_headloc.runs.plan import generation_batch
    from lm_eval_headloc.runs.spec import RunSpec

    lm = load_lm(tiny_model_dir("llama"))  # batch size 4
    measure = open_generation_measurement(task_manager, lm)
    per_copy = generating_bytes_per_mask(lm, measure)
    monkeypatch.setattr(lm, "_device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * per_copy, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert measure.auto_masks_per_pass() == int(GENERATION_MEMORY_SHARE * 10) == 8
    # With no --batch-size, a generation task on a GPU puts every example in one batch.
    assert generation_batch(RunSpec(), lm) == "auto"
    assert generation_batch(RunSpec(batch_size=32), lm) is None
    monkeypatch.setattr(lm, "_device", torch.device("cpu"))
    assert generation_batch(RunSpec(), lm) is None


def test_a_generating_run_records_and_prints_its_automatic_k(tiny_model_dir, tmp_path,
                                                             capsys):
    from helpers import LASSO_ONLY, harness, strict_json, tiny_args

    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", GENERATION_TASK,
                   *LASSO_ONLY, "--masks", "6", "--num-samples", "8",
                   "--out", str(out)) == 0
    # 8 requests, fewer than a batch (32 rows): 8 rows per mask, 128 / 8 masks per call.
    assert strict_json(out / "config.json")["masks_per_pass"] == CPU_GENERATION_ROWS // 8
    printed = capsys.readouterr().out.splitlines()
    assert "Masks per pass: 16 (automatic; --masks-per-pass sets it)" in printed
    # refit measures nothing: no pass, no line.
    assert harness("refit", str(out)) == 0
    assert "Masks per pass" not in capsys.readouterr().out
    # Asked for: recorded in the spec only.
    again = tmp_path / "asked"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", GENERATION_TASK,
                   *LASSO_ONLY, "--masks", "6", "--num-samples", "8", "--masks-per-pass", "2",
                   "--out", str(again)) == 0
    config = strict_json(again / "config.json")
    assert "masks_per_pass" not in config and config["spec"]["masks_per_pass"] == 2
    assert "Masks per pass" not in capsys.readouterr().out


def test_ids_past_the_tokenizer_that_decode_to_nothing_are_not_looked_at(tiny_model_dir):
    # A model's vocabulary padded past its tokenizer's (an untrained model generates those
    # ids as readily as any other): a fast tokenizer decodes those ids to nothing, so they
    # cannot end a stop string; looking at every row that generated one cost 1,500 rows
    # ~18 ms a step on a CPU.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    size = len(tokenizer)
    assert tokenizer.decode([size + 5]) == ""
    table = multigen.could_end(tokenizer, ("Question:",), frozenset({2}), size + 100)
    assert len(table) == size + 100 and not table[size:].any()
    assert table[:size].tolist() == multigen.could_end(tokenizer, ("Question:",),
                                                       frozenset({2})).tolist()

    class Refusing:  # a tokenizer that cannot decode an id past its own, as a slow one
        def __len__(self):
            return size

        def batch_decode(self, ids):
            if any(i >= size for row in ids for i in row):
                raise IndexError("piece id is out of range")
            return tokenizer.batch_decode(ids)

    table = multigen.could_end(Refusing(), ("Question:",), frozenset({2}), size + 100)
    assert len(table) == size  # the ids past it: looked at, as past the table


def test_rows_end_where_they_did_when_every_id_past_the_tokenizer_was_looked_at(
        tiny_model_dir):
    # Random rows of ids in and past the tokenizer's, a stop string written into some: the
    # table over the model's vocabulary ends each row where looking at every row past the
    # tokenizer did, and decodes fewer rows.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    size, vocab, rows, prompt = len(tokenizer), len(tokenizer) * 4, 64, 5
    stop = tokenizer.encode(" cat:", add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    steps = torch.randint(0, vocab, (rows, 40), generator=generator)
    for row in range(0, rows, 3):  # the stop string after a different number of tokens
        at = 4 + row % 30
        steps[row, at:at + len(stop)] = torch.tensor(stop)
    ids = torch.randint(3, size, (rows, prompt), generator=generator)
    decoded = {"old": 0, "new": 0}
    ends = {}
    for name, padded in (("old", 0), ("new", vocab)):
        stops = multigen.RowStops(tokenizer, ["cat:"], prompt, rows, [2], padded)
        multigen.could_end(tokenizer, ("cat:",), frozenset({2}), padded)  # made: not counted
        real = tokenizer.batch_decode

        def counting(tails, name=name, real=real):
            decoded[name] += len(tails)
            return real(tails)

        tokenizer.batch_decode = counting
        try:
            for step in range(steps.shape[1]):
                stops(torch.cat([ids, steps[:, :step + 1]], dim=1), None)
        finally:
            del tokenizer.batch_decode
        ends[name] = stops.finished_at
    assert ends["new"] == ends["old"]
    assert sum(end is not None for end in ends["new"]) >= rows // 3
    assert decoded["new"] < decoded["old"] / 4, decoded


def test_a_vocabulary_padded_past_the_tokenizer_gets_lm_evals_own_answers(
        tmp_path, task_manager, monkeypatch):
    # Half the ids this random model generates are past its tokenizer's (decoded to
    # nothing), as a model with a vocabulary padded past its tokenizer's may generate.
    from helpers import save_tiny_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.vocab_size *= 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    lm = load_lm(tmp_path)
    assert lm.model.get_output_embeddings().weight.shape[0] == 2 * len(lm.tokenizer)
    instances = with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch)
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    made, generated = made_criteria(monkeypatch), []
    real = lm.model.generate
    monkeypatch.setattr(lm.model, "generate",
                        lambda *a, **k: generated.append(real(*a, **k)) or generated[-1])
    together = multigen.generations_for_masks(lm, instances, masks, rows=5)
    monkeypatch.undo()
    # The prompts are the tokenizer's ids: those past it were generated, a good share.
    past = sum(int((out >= len(lm.tokenizer)).sum()) for out in generated)
    assert past > sum(out.numel() for out in generated) / 10
    assert len(made[0]._could_end) == 2 * len(lm.tokenizer)
    ends = [end for c in made for end in c.finished_at]
    assert len({end for end in ends if end is not None}) > 2, ends
    for heads, answers in zip(masks, together, strict=True):
        assert answers == lm_evals_own(lm, instances, heads, 5, monkeypatch), heads


def test_a_seq2seq_model_generates_as_lm_evals_own(tmp_path):
    """A seq2seq model's ``generate`` returns the decoder's tokens, without the prompt's
    columns: rows that stop on their own looked for their text past the prompt's width,
    and every greedy generation request of an encoder-decoder model (BART) ended in an
    IndexError."""
    import transformers
    from helpers import HIDDEN, VOCAB, save_tiny_tokenizer
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    torch.manual_seed(0)
    transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1)).save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    stock = HFLM(pretrained=str(tmp_path), device="cpu", batch_size=4)
    lm = HFHeadAblateLM(pretrained=stock.model, tokenizer=stock.tokenizer, device="cpu",
                        batch_size=4)
    assert lm.backend == "seq2seq"

    def requests() -> list:
        return [Instance(request_type="generate_until", doc={}, idx=i, arguments=(
            prompt, {"until": ["\n", "mat"], "max_gen_toks": 6, "do_sample": False}))
            for i, prompt in enumerate(("the cat sat on the", "Mary and John went to",
                                        "one two three"))]

    assert lm.generate_until(requests()) == stock.generate_until(requests())
    assert not multigen.stops_per_row(lm, {"do_sample": False})
