"""The locate loop without a run folder: a notebook's measurement and a ``MemoryStore``."""

import numpy as np
import pytest
from helpers import TASKS


def _options(folder) -> dict:
    return dict(model_args=f"pretrained={folder},dtype=float32", tasks=("tiny_copy_ppl",),
                include_path=(TASKS,), num_samples=8, masks=12, sparsity=0.25, confirm=3,
                group_tests=2, prior="none", bootstrap=10, progress=False)


def _without_seconds(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def test_the_loop_in_memory_measures_and_ranks_as_a_run_folder(tiny_model_dir, tmp_path):
    from lm_eval_headloc import RunSpec, locate
    from lm_eval_headloc.intervention.components import format_heads
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.designs import design_matrix
    from lm_eval_headloc.method.locate_loop import locate_components
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.setup import prepare

    options = _options(tiny_model_dir("llama"))
    on_disk = locate(tmp_path / "run", **options)
    setup = prepare(RunSpec(**options).validate())
    measure = open_measurement(setup, load_model(setup), num_samples=8)
    store = MemoryStore()
    in_memory = locate_components(measure, setup.spec, store=store)

    # The same measurements, in the same order, as the run folder holds.
    with RunFolder(tmp_path / "run") as folder:
        stored = folder.measurements()
    assert _without_seconds(store.measurements()) == _without_seconds(stored)
    # The masks are the design's rows (derived here from the design's own function), the
    # baseline first; then the 3 heads measured alone.
    rows = design_matrix("stratified", 12, 8, 0.25, 0, [])
    records = store.measurements()
    assert [r["mask"] for r in records[:13]] == ["", *(
        format_heads([f"L{i // 4}H{i % 4}" for i in np.flatnonzero(row)]) for row in rows)]
    assert all(r["key"].startswith("alone-") and r["num_knocked_out"] == 1
               for r in records[13:16])
    # Group tests: at most 2 more, each a group's or a head's it narrowed down to.
    assert 16 <= len(records) <= 18
    assert all(r["key"].startswith(("group-", "alone-")) for r in records[16:])
    # The ranking is the run folder's (and ranks something: the masks moved the score).
    assert np.ptp([r["scores"]["tiny_copy_ppl"] for r in records]) > 0
    mine, theirs = in_memory["tiny_copy_ppl"], on_disk["tiny_copy_ppl"]
    assert mine.order == theirs.order and mine.facts.confirmed == theirs.facts.confirmed
    np.testing.assert_array_equal(mine.effects, theirs.effects)

    # The same store again: every measurement is there, so nothing is measured.
    calls = []
    original = measure.measure_chunks

    def counted(chunks, *args, **kwargs):
        calls.append(len(chunks))
        return original(chunks, *args, **kwargs)

    measure.measure_chunks = counted
    again = locate_components(measure, setup.spec, store=store)
    assert calls == [] and len(store.measurements()) == len(records)
    assert again["tiny_copy_ppl"].order == in_memory["tiny_copy_ppl"].order


def test_a_store_whose_measurement_is_another_mask_is_refused(tiny_model_dir):
    import pytest

    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.measurement.store import MemoryStore, StoreError
    from lm_eval_headloc.method.locate_loop import locate_components
    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.setup import prepare

    options = {**_options(tiny_model_dir("llama")), "confirm": 0, "group_tests": 0}
    setup = prepare(RunSpec(**options).validate())
    measure = open_measurement(setup, load_model(setup), num_samples=8)
    store = MemoryStore([{"key": "mask-0000", "mask": "L1H3", "scores": {"tiny_copy_ppl": 0.0}}])
    with pytest.raises(StoreError) as refused:
        locate_components(measure, setup.spec, store=store)
    assert "'mask-0000'" in str(refused.value) and "L1H3" in str(refused.value)
    assert len(store.measurements()) == 1  # nothing measured into a store it refused


class _Scores:
    """A measurement of an 8-head model with one task, ``t``, whose ``bad``-th
    measurement scores ``bad_value``: a notebook's measure whose metric failed once."""

    tasks = [("t", None)]

    def __init__(self, bad: int, bad_value) -> None:
        from types import SimpleNamespace

        self.lm = SimpleNamespace(knockout=SimpleNamespace(
            num_layers=2, heads_per_layer=4, layers_with_heads=[0, 1]))
        self.bad, self.bad_value, self.made = bad, bad_value, 0

    def auto_masks_per_pass(self) -> int:
        return 1

    def measure_chunks(self, chunks, masks_per_pass=None, scale=None):
        from lm_eval_headloc.measurement.metrics import TaskScore

        for index, chunk in enumerate(chunks):
            scores = []
            for heads in chunk:
                value = self.bad_value if self.made == self.bad else 1.0 - 0.1 * len(heads)
                self.made += 1
                scores.append({"t": TaskScore("t", "acc,none", value, True)})
            yield index, scores, 0.0



@pytest.mark.parametrize("bad_value", [float("nan"), None, "0.5"])
def test_a_measurement_that_is_no_number_is_refused_naming_it(bad_value):
    """NaN reached the Lasso (scikit-learn's "Input y contains NaN", naming no
    measurement) and "0.5" was fitted as a number: either is now one line of the
    package's own naming the measurement, its mask and its task, and is not kept."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.intervention.components import format_heads
    from lm_eval_headloc.measurement.metrics import MetricError
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.designs import design_matrix
    from lm_eval_headloc.method.locate_loop import locate_components

    spec = RunSpec(masks=12, sparsity=0.25, confirm=0, group_tests=0, prior="none",
                   bootstrap=5, progress=False).validate()
    store = MemoryStore()
    # The 4th measurement: the baseline, then the design's rows 0, 1 and 2.
    with pytest.raises(MetricError) as refused:
        locate_components(_Scores(3, bad_value), spec, store=store)
    message = str(refused.value)
    row = design_matrix("stratified", 12, 8, 0.25, 0, [])[2]
    mask = format_heads([f"L{i // 4}H{i % 4}" for i in np.flatnonzero(row)])
    for named in ("'mask-0002'", mask, "'t'", repr(bad_value), "--signal logprob"):
        assert named in message, (named, message)
    assert len(message.splitlines()) == 1
    assert [r["key"] for r in store.measurements()] == ["baseline", "mask-0000", "mask-0001"]


def test_a_measurement_of_numpy_numbers_is_kept_as_plain_numbers():
    """A notebook's measurement may return numpy scores: they are numbers, kept as
    Python's own (the record's JSON takes them), not refused as "not a finite number"."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.locate_loop import locate_components

    spec = RunSpec(masks=12, sparsity=0.25, confirm=0, group_tests=0, prior="none",
                   bootstrap=5, progress=False).validate()
    store = MemoryStore()
    locate_components(_Scores(3, np.float32(0.75)), spec, store=store)
    record = next(r for r in store.measurements() if r["key"] == "mask-0002")
    assert type(record["scores"]["t"]) is float and record["scores"]["t"] == 0.75


def test_a_design_the_pilot_would_fill_is_refused_before_it_is_measured():
    """locate_components with --sparsity auto and fewer masks than its pilot takes (which
    prepare refuses for the CLI and locate()) measured the pilot, then failed with
    "num_masks=-4: must be a whole number >= 1". Now the CLI's one line, nothing measured."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.locate_loop import locate_components
    from lm_eval_headloc.method.pilot import pilot_design

    pilot = len(pilot_design(8, 0)[0])
    spec = RunSpec(masks=pilot, sparsity="auto", confirm=0, group_tests=0, prior="none",
                   bootstrap=5, progress=False).validate()
    store, measure = MemoryStore(), _Scores(-1, None)
    with pytest.raises(UsageError, match=rf"^--masks {pilot}: --sparsity auto's pilot alone "
                       rf"takes {pilot} measurements; give more$"):
        locate_components(measure, spec, store=store)
    assert measure.made == 0 and not list(store.measurements())
    # One mask more than the pilot: measured whole.
    locate_components(measure, spec.replace(masks=pilot + 1), store=store)
    assert measure.made > pilot


class _Planted(_Scores):
    """``_Scores``' 8-head model whose score falls by each knocked-out head's planted harm;
    it lists the knockouts it made."""

    harms = {"L0H0": 0.30, "L0H3": 0.20, "L1H1": 0.12, "L1H2": 0.08, "L0H1": 0.05}

    def __init__(self) -> None:
        super().__init__(-1, None)
        self.made: list[str] = []

    def measure_chunks(self, chunks, masks_per_pass=None, scale=None):
        from lm_eval_headloc.intervention.components import format_heads
        from lm_eval_headloc.measurement.metrics import TaskScore

        for index, chunk in enumerate(chunks):
            scores = []
            for heads in chunk:
                self.made.append(format_heads(heads))
                value = 1.0 - sum(self.harms.get(str(h), 0.0) for h in heads)
                scores.append({"t": TaskScore("t", "acc,none", value, True)})
            yield index, scores, 0.0


def test_masks_of_one_head_leave_their_heads_to_the_group_stage_and_are_not_remeasured():
    """On 8 heads at sparsity 0.1 every mask knocks out one head. The group stage took such
    a mask for its head measured alone (it planned nothing for it) while the certificate did
    not (the head stayed unchecked): the run ended "not certified, 4 unchecked", advising a
    --max-measurements that, given, measured nothing new. Now the group stage measures those
    heads alone, and a head alone whose knockout a mask made is that mask's record copied."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.designs import design_matrix
    from lm_eval_headloc.method.locate_loop import locate_components

    design = design_matrix("stratified", 12, 8, 0.1, 0, [])
    assert (design.sum(axis=1) == 1).all()  # the case: masks of one head each
    spec = RunSpec(masks=12, sparsity=0.1, confirm=4, prior="none", max_measurements=40,
                   bootstrap=5, progress=False).validate()
    measure, store = _Planted(), MemoryStore()
    (ranking,) = locate_components(measure, spec, store=store).values()
    cert = ranking.facts.certificate
    assert cert is not None and cert.certified and not cert.unchecked, cert
    assert cert.measured_alone + cert.ruled_out == 8
    # Each knockout made once: the baseline, each mask's one head, and the group tests.
    assert len(measure.made) == len(set(measure.made))
    records = {r["key"]: r for r in store.measurements()}
    for key, record in records.items():
        if key.startswith("alone-") and record["mask"] in {
                records[f"mask-{i:04d}"]["mask"] for i in range(12)}:
            assert record["same_as"].startswith("mask-"), key
    # The top-5 is the planted one, each measured alone.
    assert [str(h) for h in ranking.top(5)] == list(_Planted.harms)


class _Helped(_Scores):
    """A 32-head model (4 layers of 8) whose score falls by each knocked-out head's planted
    harm; two heads help. With the design of seed 2, mask-0006 knocks out L3H2 (0.15, the
    4th) beside L2H7 (-0.15): the mask's change is 0."""

    harms = {"L2H0": 0.3, "L3H4": 0.25, "L0H7": 0.2, "L3H2": 0.15, "L1H2": 0.1,
             "L2H4": -0.2, "L2H7": -0.15}

    def __init__(self) -> None:
        from types import SimpleNamespace

        super().__init__(-1, None)
        self.lm = SimpleNamespace(knockout=SimpleNamespace(
            num_layers=4, heads_per_layer=8, layers_with_heads=[0, 1, 2, 3]))

    def measure_chunks(self, chunks, masks_per_pass=None, scale=None):
        from lm_eval_headloc.measurement.metrics import TaskScore

        for index, chunk in enumerate(chunks):
            yield index, [{"t": TaskScore("t", "acc,none", 0.8 - sum(
                self.harms.get(str(h), 0.0) for h in heads), True)} for heads in chunk], 0.0


def test_a_mask_holding_a_head_measured_to_help_rules_out_none_of_its_heads():
    """The prior's five likeliest, L2H7 among them, are measured alone: L2H7 helps by
    0.15. The mask knocking it out beside L3H2 changed nothing, and ruled L3H2 out: the
    run was certified with L3H2 (truly 4th) 6th and a head of no harm 5th, by its
    estimate. The helper's help is added back to the mask (0.15, over the bar): L3H2 is
    group tested and measured alone."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.method.designs import design_matrix
    from lm_eval_headloc.method.locate_loop import locate_components

    mask = design_matrix("stratified", 12, 32, 0.1, 2)[6]
    assert {f"L{i // 8}H{i % 8}" for i in np.flatnonzero(mask)} >= {"L3H2", "L2H7"}
    prior = np.zeros(32)
    for rank, name in enumerate(["L2H0", "L3H4", "L0H7", "L1H2", "L2H7"]):
        prior[int(name[1]) * 8 + int(name[3])] = rank - 5.0  # most negative: likeliest
    spec = RunSpec(masks=12, sparsity=0.1, confirm=5, prior="none", max_measurements=32,
                   bootstrap=5, seed=2, progress=False).validate()
    (ranking,) = locate_components(_Helped(), spec, priors={"t": prior}).values()
    cert = ranking.facts.certificate
    assert cert.certified
    assert [str(h) for h in ranking.top(5)] == ["L2H0", "L3H4", "L0H7", "L3H2", "L1H2"]
    assert ranking.measured_alone("L3H2")


def test_a_helper_excluded_after_it_was_measured_still_gives_its_help_back(monkeypatch):
    """`refit --exclude L2H7` of the run above: the helper left the ranking, and with it
    the certificate's heads measured alone, so the sets holding it were read without its
    help (group_tests' own test has the head this rules out). The ranking hands the
    certificate each head measured alone and left out, with its measured harm."""
    from lm_eval_headloc import RunSpec
    from lm_eval_headloc.intervention.components import parse_heads
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method import rank
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.locate_loop import locate_loop

    prior = np.zeros(32)
    for place, name in enumerate(["L2H0", "L3H4", "L0H7", "L1H2", "L2H7"]):
        prior[int(name[1]) * 8 + int(name[3])] = place - 5.0
    spec = RunSpec(masks=12, sparsity=0.1, confirm=5, prior="none", max_measurements=32,
                   bootstrap=5, seed=2, progress=False).validate()
    columns = Columns.heads(4, 8)
    state = locate_loop(_Helped(), MemoryStore(), columns, ["t"], spec,
                        priors={"t": prior}, heads_per_layer=8)
    handed = []
    real = rank.certificate
    monkeypatch.setattr(rank, "certificate", lambda *args, **kwargs: (
        handed.append(kwargs.get("left_out")), real(*args, **kwargs))[1])
    for exclude in ("", "L2H7"):
        rank.fit_rankings(state.design, state.records, ["t"], columns, spec.alpha,
                          parse_heads(exclude, 4, 8) if exclude else (), top_k=5,
                          bootstrap=None, keys=state.row_keys, confirmed=state.confirm,
                          heads_per_layer=8)
    helper = columns.index(parse_heads("L2H7", 4, 8)[0])
    assert [dict(left) for left in handed] == [{}, {helper: pytest.approx(
        rank.Harm(-0.15, 0.0))}]
