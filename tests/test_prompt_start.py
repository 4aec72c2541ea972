"""The prompts' common start computed once per ``generate`` call (``prompt_start``): the
same answers as the left-padded batch computed whole, for every architecture, mask and
masks sharing a call, with less computed."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHITECTURES,
    GENERATION_MASKS,
    load_lm,
    open_generation_measurement,
    with_stops_that_end_rows,
)

import lm_eval_headloc.intervention.multigen as multigen
from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.intervention.prompt_start import laid_out, shared_start

PAD = 0
#: The families whose tiny configs have sliding-window layers (Mistral's default window):
#: their key/value cache is not a plain list of full-attention layers.
SLIDING_WINDOW = {"gemma2", "mistral"}


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_the_shared_start_is_the_tokens_every_prompt_begins_with():
    ids, mask = left_padded([[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 7, 8, 2, 3]])
    assert shared_start(ids, mask) == 3  # 5 6 7; the third row's 8 is not in the second's
    # At most the shortest prompt less one token: generate computes at least one.
    ids, mask = left_padded([[5, 6, 7], [5, 6, 7, 8]])
    assert shared_start(ids, mask) == 2
    assert shared_start(*left_padded([[1, 6], [5, 6]])) == 0  # differ at the first
    assert shared_start(*left_padded([[5, 6, 7]])) == 0  # one row: nothing to share
    ids = torch.tensor([[5, 6, 7], [5, 6, 8]])
    assert shared_start(ids, None) == 2  # no padding
    # Padding that is not on the left (right padding): not laid out, nothing shared.
    right = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    assert shared_start(right, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])) == 0


def test_each_row_is_laid_out_start_padding_rest():
    ids, mask = left_padded([[5, 6, 7, 8, 9], [5, 6, 1], [5, 6, 7, 2]])
    out, out_mask = laid_out(ids, mask, 2)
    assert out.tolist() == [[5, 6, 7, 8, 9], [5, 6, PAD, PAD, 1], [5, 6, PAD, 7, 2]]
    assert out_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 1], [1, 1, 0, 1, 1]]
    # Each row's tokens in order, and the positions generate gives them (the cumulative
    # sum of the mask) those of the left-padded row.
    for row, new, m, new_m in zip(ids, out, mask, out_mask, strict=True):
        assert new[new_m.bool()].tolist() == row[m.bool()].tolist()
        assert ((new_m.cumsum(0) - 1)[new_m.bool()].tolist()
                == (m.cumsum(0) - 1)[m.bool()].tolist())


def with_a_common_start(instances, start: str = "the cat sat on the mat when Mary and "):
    """``instances`` with ``start`` before every prompt."""
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", doc=i.doc, idx=i.idx,
                     arguments=(start + i.args[0], i.args[1])) for i in instances]


def tokens_computed(lm) -> list[int]:
    """The tokens ``lm``'s model computes from now on (every forward's input), in a list."""
    seen = [0]

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen[0] += int(ids.numel())

    lm.model.register_forward_pre_hook(count, with_kwargs=True)
    return seen


def answers(lm, instances, masks, rows, shared: bool):
    lm.shares_prompt_start = shared
    return multigen.generations_for_masks(lm, instances, masks, rows=rows)


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_the_same_answers_as_the_whole_prompts(tiny_model_dir, task_manager, family,
                                               monkeypatch):
    lm = load_lm(tiny_model_dir(family))
    instances = with_a_common_start(with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch))
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    computed = tokens_computed(lm)
    whole = answers(lm, instances, masks, 5, shared=False)
    computed_whole, computed[0] = computed[0], 0
    assert len({tuple(a) for a in whole}) > 1  # the masks answer differently
    assert answers(lm, instances, masks, 5, shared=True) == whole
    computed_shared = computed[0]
    # One mask at a time, as lm-eval's own generate_until asks (K = 1).
    lm.batch_size_per_gpu = 5
    for heads, mask_answers in zip(masks, whole, strict=True):
        with lm.knocking_out(heads):
            assert lm.generate_until(list(instances), disable_tqdm=True) == mask_answers
    if family in SLIDING_WINDOW:
        # Sliding-window layers: the window would count the padding; computed whole.
        assert not lm.shares_prompt_start
    else:
        assert lm.shares_prompt_start
        assert computed_shared < computed_whole * 0.8, (computed_shared, computed_whole)


def test_a_model_with_recurrent_layers_is_computed_whole(tiny_hybrid_dir, task_manager,
                                                         monkeypatch):
    lm = load_lm(tiny_hybrid_dir)
    instances = with_a_common_start(with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch))
    masks = [[], parse_heads("L1H0+L3H2", 4, 4), parse_heads("L3H*", 4, 4)]
    whole = answers(lm, instances, masks, 4, shared=False)
    assert answers(lm, instances, masks, 4, shared=True) == whole
    assert not lm.shares_prompt_start  # its cache holds recurrent states: not copied


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
@pytest.mark.parametrize("share", [0.01, None])  # a pause at every row's end; the default
def test_finished_rows_leave_the_batch_with_the_same_answers(tiny_model_dir, task_manager,
                                                            family, share, monkeypatch):
    import lm_eval_headloc.intervention.leaving_rows as leaving_rows
    import lm_eval_headloc.intervention.model as model

    if share is not None:
        monkeypatch.setattr(leaving_rows, "LEAVE_SHARE", share)
    calls = []  # per generate call, the rows of each of its segments
    real_call, real_segment = model.generate_leaving_rows, leaving_rows._Rows.__init__

    def call(*args, **kwargs):
        calls.append([])
        return real_call(*args, **kwargs)

    def segment(self, stops, rows, *args):
        calls[-1].append(len(rows))
        real_segment(self, stops, rows, *args)

    monkeypatch.setattr(model, "generate_leaving_rows", call)
    monkeypatch.setattr(leaving_rows._Rows, "__init__", segment)
    lm = load_lm(tiny_model_dir(family))
    instances = with_a_common_start(with_stops_that_end_rows(
        lm, open_generation_measurement(task_manager, lm).generating_instances(), monkeypatch))
    masks = [parse_heads(m, 2, 4) if m else [] for m in GENERATION_MASKS]
    computed = tokens_computed(lm)
    lm.finished_rows_leave = False
    staying = answers(lm, instances, masks, 5, shared=True)
    computed_staying, computed[0] = computed[0], 0
    assert not calls
    lm.finished_rows_leave = True
    assert answers(lm, instances, masks, 5, shared=True) == staying
    if family in SLIDING_WINDOW:  # computed whole, in one call: nothing leaves
        assert not calls and computed[0] == computed_staying
        return
    # Rows left: some call went on with fewer rows than it began with, and fewer tokens
    # were computed in all.
    assert calls and any(len(rows) > 1 and rows[-1] < rows[0] for rows in calls), calls
    assert computed[0] < computed_staying, (computed[0], computed_staying)
    # One mask at a time, as lm-eval's own generate_until asks, rows leaving too.
    lm.batch_size_per_gpu = 5
    for heads, mask_answers in zip(masks, staying, strict=True):
        with lm.knocking_out(heads):
            assert lm.generate_until(list(instances), disable_tqdm=True) == mask_answers


def test_beam_search_of_prompts_with_a_common_start_is_the_models_own(tiny_model_dir):
    """Beam search repeats each row (its cache too): the common start is not shared, and
    the answers are the model's own beam search."""
    lm = load_lm(tiny_model_dir("llama"))
    ids, mask = left_padded([[5, 6, 7, 8, 9], [5, 6, 7, 11], [5, 6, 7, 8, 20, 21]])
    assert shared_start(ids, mask) == 3
    width = ids.shape[1] + 6
    generated = lm._model_generate(ids, width, stop=[], attention_mask=mask, num_beams=3,
                                   do_sample=False)
    with torch.no_grad():
        expected = lm.model.generate(input_ids=ids, attention_mask=mask, max_length=width,
                                     num_beams=3, do_sample=False,
                                     pad_token_id=lm.tokenizer.pad_token_id)
    assert generated.tolist() == expected.tolist()
