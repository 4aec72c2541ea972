"""Ablation kinds: mean ablation and scale, against computations by hand.

Every expected value here comes from the plain ``transformers`` model with hooks written
in the test: activations recorded one text at a time (no padding, no batching), means
taken with numpy-free torch code of the test's own, and the substitution done by a
pre-hook that edits one head's slice. None of it calls ``ablation.py`` or ``hooks.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ARCHITECTURES,
    MASKS,
    TASKS,
    Request,
    assert_names,
    load_lm,
    open_measurement,
    raises_naming,
)

from lm_eval_headloc.intervention.ablation import AblationError, cached_head_means, reference_texts

LM_EVAL = str(Path(sys.executable).parent / "lm_eval")
TEXTS = ["the cat sat on the mat", "Mary and John went to the store",
         "one plus two equals three", "the dog gave a drink to the cat when it sat"]
PROBE = "John gave the dog a drink and the cat sat"


def _plain(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _projection(model, family: str, layer: int):
    return model.get_submodule(ARCHITECTURES[family][2].format(l=layer))


def _means_by_hand(model, tokenizer, family: str, texts: list[str]) -> list[torch.Tensor]:
    """Each layer's mean o_proj input over every token of every text, one text at a time."""
    layers = model.config.num_hidden_layers
    seen: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    handles = [_projection(model, family, i).register_forward_pre_hook(
        lambda module, args, i=i: seen[i].append(args[0][0].detach().clone()))
        for i in range(layers)]
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            model(ids)
    for handle in handles:
        handle.remove()
    return [torch.cat(rows).double().mean(0).float() for rows in seen]


def _logits_with(model, tokenizer, family: str, edit: dict) -> torch.Tensor:
    """Logits of PROBE with ``edit[(layer, head)](slice) -> new slice`` applied by hand."""
    heads = model.config.num_attention_heads
    handles = []
    for layer in {layer for layer, _ in edit}:
        def hook(module, args, layer=layer):
            hidden = args[0].clone()
            width = hidden.shape[-1] // heads
            for (at, head), change in edit.items():
                if at == layer:
                    part = slice(head * width, (head + 1) * width)
                    hidden[..., part] = change(hidden[..., part], layer, head, width)
            return (hidden,)
        handles.append(_projection(model, family, layer).register_forward_pre_hook(hook))
    ids = tokenizer(PROBE, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    for handle in handles:
        handle.remove()
    return logits


def _lm_logits(lm) -> torch.Tensor:
    ids = torch.tensor([lm.tok_encode(PROBE)])
    with torch.no_grad():
        return lm._model_call(ids)


@pytest.fixture
def reference_file(tmp_path):
    path = tmp_path / "reference.txt"
    path.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")  # a blank line: skipped
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "opt"])
def test_mean_ablation_equals_means_recorded_and_substituted_by_hand(
        family, tiny_model_dir, reference_file, tmp_path):
    folder = tiny_model_dir(family)
    model, tokenizer = _plain(folder)
    means = _means_by_hand(model, tokenizer, family, TEXTS)
    out = [(1, 2), (0, 1), (0, 3)]

    def to_mean(_, layer, head, width):
        return means[layer][head * width:(head + 1) * width]

    expected = _logits_with(model, tokenizer, family, {h: to_mean for h in out})
    lm = load_lm(folder, ablate="L1H2+L0H1+L0H3", ablation="mean",
                 ablation_data=str(reference_file), ablation_cache=str(tmp_path / "cache"))
    torch.testing.assert_close(_lm_logits(lm), expected, rtol=1e-5, atol=1e-5)
    # Not the zero-ablation answer (the test could not pass by ignoring the kind).
    zero = _logits_with(model, tokenizer, family,
                        {h: (lambda s, *_: torch.zeros_like(s)) for h in out})
    assert (zero - expected).abs().max() > 1e-3
    assert lm.get_model_info()["ablation"] == "mean"


def test_scale_zero_is_zero_ablation_and_scale_one_no_ablation_bit_for_bit(tiny_model_dir):
    folder = tiny_model_dir("llama")
    zero = _lm_logits(load_lm(folder, ablate="L0H1+L1H3"))
    assert torch.equal(_lm_logits(load_lm(folder, ablate="L0H1+L1H3", scale=0)), zero)
    plain = _lm_logits(load_lm(folder))
    assert torch.equal(_lm_logits(load_lm(folder, ablate="L0H1+L1H3", scale=1)), plain)
    assert not torch.equal(zero, plain)
    # scale=2: the paper code's amplification, the two slices doubled by hand.
    model, tokenizer = _plain(folder)
    doubled = _logits_with(model, tokenizer, "llama",
                           {(0, 1): lambda s, *_: 2 * s, (1, 3): lambda s, *_: 2 * s})
    torch.testing.assert_close(_lm_logits(load_lm(folder, ablate="L0H1+L1H3", scale="2")),
                               doubled, rtol=1e-5, atol=1e-5)


def test_mean_with_a_scale_interpolates_towards_the_head(tiny_model_dir, reference_file,
                                                         tmp_path):
    folder = tiny_model_dir("mistral")
    model, tokenizer = _plain(folder)
    means = _means_by_hand(model, tokenizer, "mistral", TEXTS)

    def half_way(part, layer, head, width):
        mean = means[layer][head * width:(head + 1) * width]
        return mean + 0.5 * (part - mean)

    expected = _logits_with(model, tokenizer, "mistral", {(1, 0): half_way})
    lm = load_lm(folder, ablate="L1H0", ablation="mean", scale=0.5,
                 ablation_data=str(reference_file), ablation_cache=str(tmp_path))
    torch.testing.assert_close(_lm_logits(lm), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(_lm_logits(load_lm(folder, ablate="L1H0", ablation="mean", scale=1,
                                          ablation_data=str(reference_file),
                                          ablation_cache=str(tmp_path))),
                       _lm_logits(load_lm(folder)))


def test_one_mask_per_row_equals_one_mask_at_a_time_under_mean_ablation(
        tiny_model_dir, reference_file, tmp_path):
    lm = load_lm(tiny_model_dir("qwen2"), ablation="mean", ablation_data=str(reference_file),
                 ablation_cache=str(tmp_path))
    masks = [["L0H1"], ["L1H2", "L0H0"], [], ["L1H0", "L1H1", "L1H3"]]
    ids = torch.tensor([lm.tok_encode(PROBE)])
    one_at_a_time = []
    with torch.no_grad():
        for heads in masks:
            lm.set_heads(heads)
            one_at_a_time.append(lm._model_call(ids)[0])
        lm.set_heads([])
        rows = torch.zeros(len(masks), 8, dtype=torch.bool)  # flat index layer * 4 + head
        for row, heads in enumerate(masks):
            for name in heads:
                layer, head = int(name[1]), int(name[3])
                rows[row, layer * 4 + head] = True
        with lm.knocking_out(row_masks=rows):
            together = lm._model_call(ids.repeat(len(masks), 1))
    for row, expected in enumerate(one_at_a_time):
        torch.testing.assert_close(together[row], expected, rtol=1e-5, atol=1e-6)


def test_means_are_cached_by_model_data_and_dtype_and_foreign_files_are_refused(
        tiny_model_dir, reference_file, tmp_path, monkeypatch):
    folder, cache = tiny_model_dir("llama"), tmp_path / "cache"
    first = load_lm(folder, ablate="L0H1", ablation="mean",
                    ablation_data=str(reference_file), ablation_cache=str(cache))
    assert Path(first.means_file).parent == cache and Path(first.means_file).is_file()

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the means were computed again instead of read from the cache")

    monkeypatch.setattr("lm_eval_headloc.intervention.model.head_means", no_second_pass)
    again = load_lm(folder, ablate="L0H1", ablation="mean",
                    ablation_data=str(reference_file), ablation_cache=str(cache))
    assert again.means_file == first.means_file
    assert torch.equal(_lm_logits(again), _lm_logits(first))
    monkeypatch.undo()
    other = tmp_path / "other.txt"
    other.write_text("\n".join(TEXTS[:2]), encoding="utf-8")
    changed = load_lm(folder, ablate="L0H1", ablation="mean", ablation_data=str(other),
                      ablation_cache=str(cache))
    assert changed.means_file != first.means_file
    # A file of our name that is not these means is never replaced.
    Path(first.means_file).write_bytes(b"somebody else's file")
    with raises_naming(AblationError, str(first.means_file)):
        load_lm(folder, ablate="L0H1", ablation="mean", ablation_data=str(reference_file),
                ablation_cache=str(cache))
    assert Path(first.means_file).read_bytes() == b"somebody else's file"


def test_the_weights_fingerprint_makes_no_float64_copy_and_keeps_old_cache_keys(
        tiny_model_dir, monkeypatch):
    """Mean ablation's cache key sums every parameter in float64: a float64 copy of an 8B
    model's embedding is 4 GiB more on its GPU. The key is the one caches were written
    under (name, shape and the float64 sum of each parameter, as computed before)."""
    import hashlib

    from lm_eval_headloc.intervention.model import _weights_fingerprint

    model = load_lm(tiny_model_dir("llama"), dtype="bfloat16").model
    expected = hashlib.sha256()
    for name, tensor in model.named_parameters():
        total = float(tensor.detach().to(torch.float64).sum())
        expected.update(f"{name}{tuple(tensor.shape)}{total!r}".encode())

    def no_copy(self, *args, **kwargs):
        raise AssertionError("a float64 copy of a parameter")

    monkeypatch.setattr(torch.Tensor, "double", no_copy)
    assert _weights_fingerprint(model) == expected.hexdigest()


def test_cache_keeps_what_compute_gave_and_writes_no_partial_file(tmp_path):
    means = [torch.arange(6.0).view(2, 3)]
    got, path = cached_head_means({"model": "m"}, lambda: means, tmp_path)
    assert torch.equal(got[0], means[0])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    again, same = cached_head_means({"model": "m"}, lambda: 1 / 0, tmp_path)
    assert same == path and torch.equal(again[0], means[0])


def _tiny_copy_contexts() -> list[str]:
    """tiny_copy's prompts ({{context}}), read from its documents, not through lm-eval."""
    sys.path.insert(0, str(Path(TASKS) / "tiny_copy"))
    try:
        import utils as tiny_copy_utils
    finally:
        sys.path.pop(0)
    return [doc["context"] for doc in tiny_copy_utils.load_docs()["test"]]


def test_a_task_from_an_include_path_is_a_reference_set(tiny_model_dir, tmp_path):
    # The stock CLI's --include_path never reaches the model; ablation_include_path does.
    folder = tiny_model_dir("llama")
    model, tokenizer = _plain(folder)
    means = _means_by_hand(model, tokenizer, "llama", _tiny_copy_contexts())

    def to_mean(_, layer, head, width):
        return means[layer][head * width:(head + 1) * width]

    expected = _logits_with(model, tokenizer, "llama", {(1, 2): to_mean, (0, 1): to_mean})
    lm = load_lm(folder, ablate="L1H2+L0H1", ablation="mean", ablation_data="tiny_copy",
                 ablation_include_path=TASKS, ablation_cache=str(tmp_path / "cache"))
    torch.testing.assert_close(_lm_logits(lm), expected, rtol=1e-5, atol=1e-5)
    # Other means than TEXTS' (the task's prompts were used, not some other set).
    other = _means_by_hand(model, tokenizer, "llama", TEXTS)
    assert (other[1] - means[1]).abs().max() > 1e-3


def test_reference_sets_from_jsonl_and_from_a_task(tmp_path, task_manager):
    jsonl = tmp_path / "ref.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "prompt": t.upper()}) for t in TEXTS),
                     encoding="utf-8")
    assert reference_texts(jsonl) == TEXTS
    assert reference_texts(jsonl, "prompt") == [t.upper() for t in TEXTS]
    # A task: each evaluated document's prompt, here tiny_copy's {{context}} field.
    assert reference_texts("tiny_copy", task_manager=task_manager) == _tiny_copy_contexts()


def test_a_task_reference_set_is_the_text_the_model_reads(tmp_path, task_manager):
    # A perplexity task's prompt is empty (wikitext's doc_to_text: ""): its text is its
    # target, the one request lm-eval makes of each document.
    assert reference_texts("tiny_rolling", task_manager=task_manager) == _tiny_copy_contexts()
    # A multiple-input task's prompt is the gold choice's index (Winogrande's): its texts
    # are the contexts it offers, not "0" and "1".
    from lm_eval_headloc.tasks import make_task_manager

    rows = [{"sentence": "Mary gave John a drink because _ was kind.", "option1": "Mary",
             "option2": "John", "answer": "1"},
            {"sentence": "the cat sat on the mat and _ slept.", "option1": "the cat",
             "option2": "the mat", "answer": "2"}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "wino.yaml").write_text(f"""task: tiny_wino
dataset_path: json
dataset_kwargs: {{data_files: {{test: {tmp_path / 'docs.jsonl'}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ {{'1': 0, '2': 1}}[answer] }}}}"
doc_to_choice: "{{% set s = sentence[:sentence.index('_')] %}}{{{{ [s + option1, s + option2] }}}}"
doc_to_target: "{{{{ sentence[sentence.index('_') + 1:].strip() }}}}"
metric_list: [{{metric: acc}}]
""")
    assert reference_texts("tiny_wino", task_manager=make_task_manager([str(tmp_path)])) == [
        "Mary gave John a drink because Mary", "Mary gave John a drink because John",
        "the cat sat on the mat and the cat", "the cat sat on the mat and the mat"]


@pytest.mark.parametrize("args, values", [  # the bad value and what is allowed instead
    (dict(ablation="median"), ("ablation='median'", "zero, mean, resample")),
    (dict(ablation="mean"), ("ablation=mean", "ablation_data=")),
    (dict(scale="big"), ("scale='big'",)),
    (dict(scale="inf"), ("scale='inf'",)),
    (dict(scale=True), ("scale=True",)),
    (dict(ablation_data="x.txt"), ("ablation_data=", "mean", "resample")),
    (dict(ablation="resample", ablation_data="ONE"), ("ablation=resample", "two", "has 1")),
    (dict(ablation="resample", ablation_data="JSONL", resample_seed=-1),
     ("resample_seed=-1", ">= 0")),
    # `lm-eval run --model_args resample_seed=-1` types a signed number a float: told as
    # written, not as -1.0.
    (dict(ablation="resample", ablation_data="JSONL", resample_seed=-1.0),
     ("resample_seed=-1:", ">= 0")),
    (dict(ablation="mean", ablation_data="no_such_file_or_task"),
     ("ablation_data='no_such_file_or_task'",)),
    (dict(ablation="mean", ablation_data="EMPTY"), ("ablation_data='{EMPTY}'",)),
    # tests/tasks is not where lm-eval looks unless the model is told.
    (dict(ablation="mean", ablation_data="tiny_copy"),
     ("ablation_data='tiny_copy'", "ablation_include_path=DIR")),
    # Settings another ablation kind takes were accepted and did nothing (an audit).
    (dict(resample_seed=7), ("resample_seed=7", "ablation=resample", "ablation=zero")),
    (dict(ablation="mean", ablation_data="JSONL", resample_seed=0),
     ("resample_seed=0", "ablation=resample", "ablation=mean")),
    (dict(ablation_cache="x"), ("ablation_cache='x'", "ablation=mean", "ablation=zero")),
    (dict(ablation="resample", ablation_data="JSONL", ablation_cache="x"),
     ("ablation_cache='x'", "ablation=mean", "ablation=resample")),
    # '' was the current folder: the means cached wherever the command ran.
    (dict(ablation="mean", ablation_data="JSONL", ablation_cache=""),
     ("ablation_cache=''", "a folder")),
    (dict(ablation="mean", ablation_data="tiny_copy", ablation_include_path="NOFOLDER"),
     ("ablation_include_path='{NOFOLDER}'",)),
    (dict(ablation_include_path="TASKS"), ("ablation_include_path=", "mean", "resample")),
    # '' would be the current folder, not a mistake caught.
    (dict(ablation="mean", ablation_data="tiny_copy", ablation_include_path=""),
     ("ablation_include_path=''",)),
    (dict(ablation="mean", ablation_data="JSONL", ablation_field=" "),
     ("ablation_field=' '", "'text'")),
    (dict(ablation="mean", ablation_data="DIR"), ("ablation_data='{DIR}'",)),
    (dict(ablation="mean", ablation_data="JSONL", ablation_field="body"),
     ("ablation_data='{JSONL}'", "line 1", "'body'", "prompt, text")),
])
def test_bad_ablation_input_is_one_line_before_any_weights_load(args, values, tmp_path):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    (tmp_path / "ref.jsonl").write_text(json.dumps({"text": "a", "prompt": "b"}) + "\n",
                                        encoding="utf-8")
    (tmp_path / "one.txt").write_text("one example\none example\n", encoding="utf-8")
    where = {"EMPTY": tmp_path / "empty.txt", "DIR": tmp_path, "JSONL": tmp_path / "ref.jsonl",
             "ONE": tmp_path / "one.txt"}
    where.update(NOFOLDER=tmp_path / "no-such-folder", TASKS=TASKS)
    args = {k: str(where.get(v, v)) if k in ("ablation_data", "ablation_include_path") else v
            for k, v in args.items()}
    # No such model folder: an error about the weights would mean the check came too late.
    with raises_naming(AblationError, *(v.format(**where) for v in values)) as error:
        HFHeadAblateLM(pretrained=str(tmp_path / "no-model-here"), **args)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_stock_cli_runs_mean_and_resample_and_refuses_a_bad_kind(tiny_model_dir, reference_file,
                                                             tmp_path):
    folder = tiny_model_dir("llama")
    base = [LM_EVAL, "--model", "hf-headablate", "--device", "cpu", "--tasks", "tiny_copy",
            "--include_path", TASKS, "--limit", "4"]
    # mean's reference set is a task of the --include_path folder, resample's a file.
    reference = {"mean": f"ablation_data=tiny_copy,ablation_include_path={TASKS},"
                         f"ablation_cache={tmp_path / 'cache'}",
                 "resample": f"ablation_data={reference_file}"}
    # The three processes run at once: each spends its ~15 s importing and indexing tasks.
    running = {}
    for kind in ("mean", "resample"):
        args = (f"pretrained={folder},dtype=float32,ablate=L0H1,ablation={kind},scale=0.5,"
                f"{reference[kind]}")
        running[kind] = subprocess.Popen(
            [*base, "--model_args", args, "--output_path", str(tmp_path / kind)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    running["median"] = subprocess.Popen(
        [*base, "--model_args", f"pretrained={folder},ablation=median"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = {kind: process.communicate(timeout=300)[1] for kind, process in running.items()}
    for kind in ("mean", "resample"):
        assert running[kind].returncode == 0, stderr[kind][-3000:]
        results = json.loads(next((tmp_path / kind).rglob("results_*.json")).read_text())
        assert "tiny_copy" in results["results"]
        assert results["config"]["model_args"]["ablation"] == kind
    assert any((tmp_path / "cache").glob("means-*.pt"))
    assert running["median"].returncode != 0 and "Traceback" not in stderr["median"]
    assert_names(stderr["median"], "ablation='median'", "zero, mean, resample")


# --- resample ------------------------------------------------------------------------

def _recorded_by_hand(model, tokenizer, family: str, text: str) -> list[torch.Tensor]:
    """Each layer's o_proj input (positions, H*d) on ``text`` alone."""
    layers = model.config.num_hidden_layers
    seen: list[torch.Tensor] = [None] * layers
    handles = [_projection(model, family, i).register_forward_pre_hook(
        lambda module, args, i=i: seen.__setitem__(i, args[0][0].detach().clone()))
        for i in range(layers)]
    with torch.no_grad():
        model(tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids)
    for handle in handles:
        handle.remove()
    return seen


def _patched_by_donor(donor: list[torch.Tensor]):
    """A slice edit: position i gets the donor's position min(i, donor length - 1)."""
    def patch(part, layer, head, width):
        values = donor[layer][:, head * width:(head + 1) * width]
        picked = torch.clamp(torch.arange(part.shape[-2]), max=values.shape[0] - 1)
        return values[picked]
    return patch


# The first reference is PROBE itself, its own document, so it is passed over and the
# second is the donor whatever the hash: one shorter than PROBE (its last position
# repeats), one longer (cut to PROBE's length).
DONORS = {"short": "Mary and John went", "long": "Mary and John went to the store and the "
          "dog gave a drink to the cat when it sat down on the mat by the door"}


@pytest.mark.parametrize("family, donor", [("llama", "short"), ("qwen3", "long"),
                                           ("gpt2", "short"), ("opt", "long")])
def test_resample_equals_donor_recorded_and_patched_by_hand(family, donor, tiny_model_dir,
                                                            tmp_path):
    folder = tiny_model_dir(family)
    model, tokenizer = _plain(folder)
    reference = tmp_path / "reference.txt"
    reference.write_text(f"{PROBE}\n{DONORS[donor]}\n", encoding="utf-8")
    patch = _patched_by_donor(_recorded_by_hand(model, tokenizer, family, DONORS[donor]))
    out = [(1, 2), (0, 1), (0, 3)]
    expected = _logits_with(model, tokenizer, family, {h: patch for h in out})
    lm = load_lm(folder, ablate="L1H2+L0H1+L0H3", ablation="resample",
                 ablation_data=str(reference))
    with torch.no_grad():
        got = lm._model_call(torch.tensor([lm.tok_encode(PROBE)]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    zero = _logits_with(model, tokenizer, family,
                        {h: (lambda s, *_: torch.zeros_like(s)) for h in out})
    assert (zero - expected).abs().max() > 1e-3
    assert lm.get_model_info()["ablation"] == "resample"


def test_resample_donor_follows_the_row_not_its_batch_or_padding(tiny_model_dir, tmp_path):
    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(TEXTS + list(DONORS.values())), encoding="utf-8")
    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1+L1H0", ablation="resample",
                 ablation_data=str(reference))
    rows = [lm.tok_encode(t) for t in (PROBE, DONORS["long"], "the cat")]
    batch = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, tokens in enumerate(rows):
        batch[i, :len(tokens)] = torch.tensor(tokens)
    with torch.no_grad():
        together = lm._model_call(batch)
        for i, tokens in enumerate(rows):
            alone = lm._model_call(torch.tensor([tokens]))[0]
            torch.testing.assert_close(together[i, :len(tokens)], alone, rtol=1e-5, atol=1e-5)
    # Another seed picks other donors for some rows, so the answers move.
    other = load_lm(tiny_model_dir("llama"), ablate="L0H1+L1H0", ablation="resample",
                    ablation_data=str(reference), resample_seed=7)
    with torch.no_grad():
        assert not torch.allclose(other._model_call(batch), together)


def test_resample_holds_each_donor_once_however_many_copies_of_its_rows(tiny_model_dir,
                                                                         tmp_path):
    """K masks per pass repeat a batch's rows K times; the donors' outputs (rows x width x
    every layer's H·d, the largest tensors of a pass) are held once per distinct donor."""
    from lm_eval_headloc.intervention.ablation import pick_donor

    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(TEXTS + list(DONORS.values())), encoding="utf-8")
    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1", ablation="resample",
                 ablation_data=str(reference))
    rows = [lm.tok_encode(t) for t in (PROBE, DONORS["long"], "the cat")] * 4  # K = 4
    resampler = lm.resampler
    distinct = {pick_donor(r, resampler.references, resampler.seed) for r in rows}
    assert 1 < len(distinct) < len(rows)
    width = max(map(len, rows))
    with torch.no_grad(), lm.knockout.applied(None):
        stacked, index = resampler.donors(lm.model, lm.knockout.site_modules(["heads"]), rows,
                                          [0] * len(rows), width)
    assert [block.shape[0] for block in stacked] == [len(distinct)] * len(stacked)
    assert index.shape == (len(rows), width)
    # Each row's columns point into its own donor's positions.
    widest = stacked[0].shape[1]
    for row, tokens in zip(index.tolist(), rows, strict=True):
        donor = pick_donor(tokens, resampler.references, resampler.seed)
        slot = sorted(distinct).index(donor)
        length = len(resampler.references[donor])
        assert row == [slot * widest + min(c, length - 1) for c in range(width)]


def test_resample_and_mean_masks_per_pass_equal_hflm_one_mask_at_a_time(
        tiny_model_dir, task_manager, tmp_path):
    from lm_eval_headloc.intervention.components import parse_heads
    from lm_eval_headloc.intervention.multimask import RecordingLM, loglikelihoods_for_masks

    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(TEXTS), encoding="utf-8")
    for kind in ("resample", "mean"):
        lm = load_lm(tiny_model_dir("qwen2"), ablation=kind, ablation_data=str(reference),
                     **({"ablation_cache": str(tmp_path)} if kind == "mean" else {}))
        measurement = open_measurement(task_manager, lm, ["tiny_copy_ppl", "tiny_choice"])
        recorder = RecordingLM(lm)
        measurement.evaluate([], model=recorder)
        requests = recorder.requests
        masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
        together = loglikelihoods_for_masks(lm, requests, masks, batch_size=8)
        changed = 0
        for heads, answers in zip(masks, together, strict=True):
            lm.set_heads(heads)
            alone = lm.loglikelihood([Request(r) for r in requests], disable_tqdm=True)
            for request, (logprob, greedy) in zip(requests, alone, strict=True):
                assert answers[request][0] == pytest.approx(logprob, abs=1e-4), kind
                assert answers[request][1] == greedy
            changed += any(abs(answers[r][0] - together[1][r][0]) > 1e-3 for r in requests)
        assert changed >= 4, kind  # the knockouts do change the answers
        lm.set_heads([])


def test_resample_generation_uses_the_kv_cache_and_equals_patching_by_hand(
        tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    model, tokenizer = _plain(folder)
    reference = tmp_path / "reference.txt"
    reference.write_text(f"{PROBE}\n{DONORS['short']}\n", encoding="utf-8")
    patch = _patched_by_donor(_recorded_by_hand(model, tokenizer, "llama", DONORS["short"]))
    heads = model.config.num_attention_heads
    hooks = []
    for layer, head in [(0, 1), (1, 2)]:
        def hook(module, args, layer=layer, head=head):
            hidden = args[0].clone()
            width = hidden.shape[-1] // heads
            part = slice(head * width, (head + 1) * width)
            hidden[..., part] = patch(hidden[..., part], layer, head, width)
            return (hidden,)
        hooks.append(_projection(model, "llama", layer).register_forward_pre_hook(hook))
    ids = tokenizer(PROBE, add_special_tokens=False).input_ids
    with torch.no_grad():  # greedy by hand, the whole sequence every step (no cache)
        for _ in range(6):
            ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    for hook in hooks:
        hook.remove()
    lm = load_lm(folder, ablate="L0H1+L1H2", ablation="resample", ablation_data=str(reference))
    probe = lm.tok_encode(PROBE)
    short = lm.tok_encode("the cat")
    # Two rows, left-padded as HFLM pads prompts for generation.
    width = len(probe)
    context = torch.full((2, width), lm.tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    context[0], mask[0] = torch.tensor(probe), 1
    context[1, width - len(short):], mask[1, width - len(short):] = torch.tensor(short), 1
    generated = lm._model_generate(context, width + 6, stop=[], attention_mask=mask)
    assert generated[0].tolist() == ids


def test_resample_beam_search_gives_each_row_its_own_donor(tiny_model_dir, reference_file):
    """generate runs a row's beams as rows after it: each gets that row's donor, so a
    batch's rows generate as each alone."""
    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1+L1H2", ablation="resample",
                 ablation_data=str(reference_file))
    prompts = [lm.tok_encode(text) for text in (PROBE, "the cat", "Mary and John went")]
    pad = lm.tokenizer.pad_token_id or 0

    def generate(rows: list[list[int]]) -> list[list[int]]:
        width = max(map(len, rows))
        context = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = lm._model_generate(context, width + 5, stop=[], attention_mask=mask,
                                 num_beams=3, do_sample=False)
        return [row[width - len(r):].tolist() for row, r in zip(out, rows, strict=True)]

    alone = [generate([prompt])[0] for prompt in prompts]
    assert generate(prompts) == alone
    with lm.knocking_out([]):  # the test means something: resample changes the answers
        assert [generate([prompt])[0] for prompt in prompts] != alone


def test_a_prompt_tuning_adapters_means_are_over_the_texts_tokens(tiny_model_dir, tmp_path,
                                                                   reference_file):
    """A PEFT prompt-tuning model puts virtual tokens before each input: mean ablation
    averages the texts' own positions, and resample (whose donors are aligned by position)
    is refused in one line."""
    from peft import PeftModel, PromptTuningConfig, get_peft_model

    folder = tiny_model_dir("llama")
    model, _ = _plain(folder)
    torch.manual_seed(1)
    tuned = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM",
                                                     num_virtual_tokens=4))
    with torch.no_grad():
        for parameter in tuned.parameters():
            if parameter.requires_grad:
                parameter.normal_(0, 0.5)
    tuned.save_pretrained(tmp_path / "adapter")
    lm = load_lm(folder, peft=str(tmp_path / "adapter"), ablate="L1H2", ablation="mean",
                 ablation_data=str(reference_file), ablation_cache=str(tmp_path / "cache"))
    plain = PeftModel.from_pretrained(_plain(folder)[0], tmp_path / "adapter").eval()
    projection = plain.base_model.get_submodule(ARCHITECTURES["llama"][2].format(l=1))
    seen = []
    handle = projection.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        for text in TEXTS:
            ids = lm.tok_encode(text)
            plain(input_ids=torch.tensor([ids]))
            seen[-1] = seen[-1][0, -len(ids):]  # the text's positions, after the virtual ones
    handle.remove()
    mean = torch.cat(seen).double().mean(0).float()[16:24]  # head 2 of 4, 8 wide

    def write_mean(_module, args):
        hidden = args[0].clone()
        hidden[..., 16:24] = mean
        return (hidden,)

    handle = projection.register_forward_pre_hook(write_mean)
    with torch.no_grad():
        expected = plain(input_ids=torch.tensor([lm.tok_encode(PROBE)])).logits
    handle.remove()
    assert torch.allclose(_lm_logits(lm), expected, atol=1e-5)
    with lm.knocking_out([]):  # the knockout changes the answers: the test means something
        assert not torch.allclose(_lm_logits(lm), expected, atol=1e-4)
    with raises_naming(AblationError, "ablation=resample", "mean"):
        lm.set_ablation("resample", TEXTS)


def test_resample_gives_each_document_of_a_perplexity_task_its_own_donor(
        tiny_model_dir, reference_file, task_manager, monkeypatch):
    """A rolling window's context is the prefix token alone: the donor follows the whole
    window, as a prompt's would (every document got reference 0)."""
    import lm_eval

    import lm_eval_headloc.intervention.ablation as ablation

    picked = []  # (the row's tokens, its donor), at each pick
    real = ablation.pick_donor

    def pick_donor(tokens, references, seed=0, own=None):
        picked.append((tuple(tokens), real(tokens, references, seed, own)))
        return picked[-1][1]

    monkeypatch.setattr(ablation, "pick_donor", pick_donor)
    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1", ablation="resample",
                 ablation_data=str(reference_file))
    lm_eval.simple_evaluate(model=lm, tasks=["tiny_rolling"], task_manager=task_manager)
    windows = {tokens for tokens, _ in picked}
    assert len(windows) == 12  # one per document, each its whole window
    assert all(donor == real(tokens, lm.resampler.references) for tokens, donor in picked)
    assert len({donor for _, donor in picked}) > 1


def test_resample_refuses_a_seq2seq_model_in_one_line(tiny_model_dir, monkeypatch):
    lm = load_lm(tiny_model_dir("llama"))
    monkeypatch.setattr(lm, "backend", "seq2seq")  # as HFLM marks encoder-decoder models
    with raises_naming(AblationError, "ablation=resample", "mean"):  # and what to use
        lm.set_ablation("resample", TEXTS)


def test_resample_finds_the_prompt_of_a_row_whose_tokens_end_in_id_0(tiny_model_dir,
                                                                     reference_file):
    """Token id 0 is a real token in some vocabularies (GPT-2's "!"): a right-padded row's
    prompt is the longest model input it starts with, not the row with its zeros cut."""
    lm = load_lm(tiny_model_dir("llama"), ablation="resample",
                 ablation_data=str(reference_file))
    lm.remember_prompts([([5, 0], [7]), ([6, 4], [0, 0])])
    # Inputs [5, 0] (prompt [5, 0]) and [6, 4, 0] (prompt [6, 4]), right-padded with zeros.
    assert lm._unpadded([5, 0, 0, 0]) == [5, 0]  # cutting the zeros gave [5]
    assert lm._unpadded([6, 4, 0, 0, 0]) == [6, 4]
    assert lm._unpadded([9, 9, 0]) == [9, 9]  # not a remembered input: the zeros are padding


def _recorded_picks(monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """Every (row's tokens, donor) resample picks from now on, as it picks."""
    import lm_eval_headloc.intervention.ablation as ablation

    picked = []
    real = ablation.pick_donor

    def pick_donor(tokens, references, seed=0, *rest):
        picked.append((tuple(tokens), real(tokens, references, seed, *rest)))
        return picked[-1][1]

    monkeypatch.setattr(ablation, "pick_donor", pick_donor)
    return picked


@pytest.mark.parametrize("task", ["tiny_shared_input", "tiny_rolling"])
def test_resample_never_gives_a_row_its_own_document(tiny_model_dir, task_manager,
                                                      monkeypatch, task):
    """The reference set is the task's own documents. "the cat sat" + " on" and "the cat" +
    " sat on" are one model input (one row): it took the prompt of the request seen last,
    "the cat", and passed over only references it starts with, so "the cat sat" was its
    donor under some seeds: that document's answer came from its own clean outputs. A
    perplexity window (the prefix token, then the text) starts with no reference at all."""
    import lm_eval

    picked = _recorded_picks(monkeypatch)
    for seed in range(4):
        lm = load_lm(tiny_model_dir("llama"), ablate="L0H1", ablation="resample",
                     ablation_data=task, ablation_include_path=TASKS, resample_seed=seed)
        references = lm.resampler.references
        shared = lm.tok_encode("the cat")
        picked.clear()
        lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager)
        assert picked
        for tokens, donor in picked:
            if task == "tiny_rolling":  # the window is the prefix token and the text
                assert list(tokens[1:]) != references[donor][:-1]
            elif list(tokens[:len(shared)]) == shared:  # the row of both "the cat" documents
                assert references[donor] not in (lm.tok_encode("the cat sat"), shared)
            else:
                assert references[donor] != list(tokens)


def test_resample_takes_a_donor_the_row_starts_with_when_it_is_another_document():
    """Only the row's own document is passed over: a shorter prompt it starts with
    ("Mary and John went" before "Mary and John went to the") is another document."""
    from lm_eval_headloc.intervention.ablation import pick_donor

    references = [[5, 6, 7], [5, 6, 7, 8, 9], [3, 4]]
    donors = {pick_donor(references[1], references, seed) for seed in range(30)}
    assert donors == {0, 2}
    # Several documents sharing one row: none of them.
    assert {pick_donor([5, 6, 7], references, seed, [[5, 6, 7], [5, 6, 7, 8, 9]])
            for seed in range(30)} == {2}


def test_resample_picks_a_shared_rows_donor_whatever_order_its_requests_came_in(
        tiny_model_dir, reference_file):
    lm = load_lm(tiny_model_dir("llama"), ablation="resample",
                 ablation_data=str(reference_file))
    lm.remember_prompts([([5, 6, 7], [8]), ([5, 6], [7, 8])])  # one model input, [5, 6, 7]
    other = load_lm(tiny_model_dir("llama"), ablation="resample",
                    ablation_data=str(reference_file))
    other.remember_prompts([([5, 6], [7, 8]), ([5, 6, 7], [8])])
    assert lm._unpadded([5, 6, 7, 0]) == other._unpadded([5, 6, 7, 0]) == [5, 6]
    # Both its documents are kept, in either order; a row whose prompt is its one document
    # keeps none (its prompt stands for it), however often its request comes.
    assert lm._documents == other._documents == {(5, 6, 7): {(5, 6, 7), (5, 6)}}
    plain = load_lm(tiny_model_dir("llama"), ablation="resample",
                    ablation_data=str(reference_file))
    plain.remember_prompts([([1, 2], [3]), ([4, 5], [6])] * 2)
    assert plain._documents == {}


def test_resample_scores_of_a_call_do_not_depend_on_the_objects_earlier_calls(
        tiny_model_dir, reference_file):
    """One object evaluating task after task (simple_evaluate(model=lm) in a loop): an
    earlier call's request of the same model input ('the cat' + ' sat on' before 'the cat
    sat' + ' on') moved the later request's prompt, and so its donor: its score was not a
    fresh object's, though lm-eval answered the two calls from separate rows."""
    pairs = [("the cat sat", " on"), ("Mary and John went", " to the store"),
             ("one two three", " four five"), ("the dog sat on", " the mat")]
    earlier = [Request((context[:context.rindex(" ")], context[context.rindex(" "):] + more))
               for context, more in pairs]  # the same model inputs, split one word sooner

    def lm():
        return load_lm(tiny_model_dir("llama"), ablate="L0H1+L1H2+L1H0", ablation="resample",
                       ablation_data=str(reference_file))

    fresh = lm().loglikelihood([Request(pair) for pair in pairs])
    reused = lm()
    reused.loglikelihood(earlier)
    assert reused.loglikelihood([Request(pair) for pair in pairs]) == fresh
