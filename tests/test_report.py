"""A ranking's report (``report.pages``): the heatmap (unstable top heads hatched, layers
without heads and heads without an estimate grey) and the ranking table's words for a top
head that does not hurt."""

from __future__ import annotations

import numpy as np
import pytest


def _legend(figure) -> str:
    """The heatmap's legend under its panels (what its marks mean)."""
    [legend] = [t for t in figure.texts if t.get_gid() == "legend"]
    return legend.get_text()


def test_heatmap_hatches_unstable_top_heads(tmp_path):
    from matplotlib.patches import Rectangle

    from lm_eval_headloc.method.lasso import Stability
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import plot_heatmap

    selected = np.array([1.0, 0.5, 0.95, 0, 0, 0, 0, 0.55])
    ranking = Ranking("t", "acc", True, 0.5, -selected, [0, 7, 2, 1, 3, 4, 5, 6], 4,
                          stability=Stability(selected, -selected - 0.1, -selected + 0.1, 40))
    assert [str(h) for h in ranking.unstable(3)] == ["L1H3"]
    figure = plot_heatmap([ranking], 3, tmp_path / "heatmap.png")
    hatched = [p for p in figure.axes[0].patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert [(p.get_x() + 0.5, p.get_y() + 0.5) for p in hatched] == [(3, 1)]
    assert (tmp_path / "heatmap.png").stat().st_size > 0
    # Layers and heads are whole numbers: no tick between two (2 layers drew 0.25, 0.5, ...).
    axes = figure.axes[0]
    for ticks in (axes.get_xticks(), axes.get_yticks()):
        assert len(ticks) and all(float(t).is_integer() for t in ticks)


def test_an_unstable_heads_share_is_not_rounded_up_to_the_bar():
    """179 of 200 refits (89.5 %, under the 90 % bar) read "90% (unstable)"."""
    from lm_eval_headloc.method.lasso import Stability
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import ranking_table

    effects = np.array([-0.3, -0.1, 0.0, 0.2])
    selected = np.array([1.0, 179 / 200, 0.0, 0.0])
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 1, 2, 3], 2,
                      stability=Stability(selected, effects - 0.1, effects + 0.1, 200))
    assert [str(h) for h in ranking.unstable(2)] == ["L0H1"]
    rows = ranking_table(ranking, 2, "change")
    assert rows[2].endswith("| 100% |") and rows[3].endswith("| 89.5% (unstable) |")


def test_a_top_head_that_does_not_hurt_is_not_also_called_unstable():
    """A top-k place filled by a head that does not hurt: no refit counts it (``selected``
    counts refits with the head in the top-k *hurting*), so its 0 % is no instability: the
    table says "does not hurt", and unstable_in_top_k leaves it out."""
    from lm_eval_headloc.method.lasso import Stability
    from lm_eval_headloc.method.ranking import Ranking, ranked_heads_json
    from lm_eval_headloc.report.pages import ranking_table

    effects = np.array([-0.3, -0.1, 0.0, 0.2])  # higher is better: the first two hurt
    selected = np.array([1.0, 0.4, 0.0, 0.0])
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 1, 2, 3], 2,
                          stability=Stability(selected, effects - 0.1, effects + 0.1, 40))
    assert [str(h) for h in ranking.harmless(3)] == ["L1H0"]
    assert [str(h) for h in ranking.unstable(3)] == ["L0H1"]
    assert not ranking.settled(3) and not ranking.settled(2) and ranking.settled(1)
    rows = ranking_table(ranking, 3, "change")
    assert "in top-3, hurting, in 40 bootstrap refits" in rows[0]
    assert rows[2].endswith("| 100% |") and rows[3].endswith("| 40% (unstable) |")
    assert rows[4].endswith("| — (does not hurt) |")
    assert ranked_heads_json(ranking, 3)["bootstrap"]["unstable_in_top_k"] == ["L0H1"]


def test_a_hybrids_heatmap_greys_the_layers_without_heads(tmp_path):
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import plot_heatmap

    columns = Columns.heads(4, 2, head_layers=(1, 3))
    effects = np.array([-0.4, 0.1, -0.2, 0.3])
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 2, 1, 3], 2, columns=columns)
    figure = plot_heatmap([ranking], 2, tmp_path / "heatmap.png")
    shown = figure.axes[0].images[0].get_array()
    assert shown.shape == (4, 2)
    assert shown.mask[[0, 2]].all() and not shown.mask[[1, 3]].any()
    np.testing.assert_allclose(shown[[1, 3]].data, effects.reshape(2, 2))  # higher is better
    assert "grey rows: layers without attention heads" in _legend(figure)
    assert "grey: no estimate" not in _legend(figure)
    # A head never knocked out has no estimate: grey too, and said so (white is "no change").
    effects[1] = np.nan
    unknown = plot_heatmap([Ranking("t", "acc", True, 0.5, effects, [0, 2, 3], 2,
                                        columns=columns)], 2, tmp_path / "heatmap.png")
    assert "grey: no estimate" in _legend(unknown)
    assert unknown.axes[0].images[0].get_array().mask[1, 1]
    assert unknown.axes[0].get_facecolor()[:3] == pytest.approx((0.8, 0.8, 0.8))


def test_several_tasks_panels_titles_and_legend_do_not_run_into_each_other(tmp_path):
    from itertools import combinations

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from lm_eval_headloc.method.head_types import HeadTypes
    from lm_eval_headloc.method.lasso import Stability
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import plot_heatmap

    # Three tasks on a model of 30 layers x 9 heads, each with every mark a legend
    # explains: head types (all three letters), an unstable top head, a head never
    # knocked out.
    labels = [[("previous_token", "duplicate_token", "induction", None)[(i + j) % 4]
               for j in range(9)] for i in range(30)]
    types = HeadTypes({"scores": {}, "dominant": labels})
    rankings = []
    for task in ("headloc_induction", "headloc_ioi", "headloc_arith"):
        effects = -np.linspace(0.3, 0.0, 270)
        effects[200] = np.nan
        selected = np.where(np.arange(270) < 2, 1.0, 0.0)
        selected[2] = 0.5  # the third top head: unstable
        rankings.append(Ranking(task, "acc,none", True, 0.5, effects,
                                [i for i in range(270) if i != 200], 9, head_types=types,
                                stability=Stability(selected, effects, effects, 40)))
    figure = plot_heatmap(rankings, 3, tmp_path / "heatmap.png", title="locate")
    renderer = FigureCanvasAgg(figure).get_renderer()
    panels = [ax for ax in figure.axes if ax.images]
    assert len(panels) == 3
    titles = [ax.title.get_window_extent(renderer) for ax in panels]
    for a, b in combinations(titles, 2):
        assert not a.overlaps(b), (a, b)
    assert [ax.get_title() for ax in panels] == [f"{r.task} (acc,none)" for r in rankings]
    # Each explanation once, under every panel (its tick labels and axis labels too), and
    # inside the figure.
    legend = next(t for t in figure.texts if t.get_gid() == "legend")
    box = legend.get_window_extent(renderer)
    for ax in figure.axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), ax
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.x1
    lines = legend.get_text().splitlines()
    assert len(lines) == len(set(lines))
    assert {line.split(":")[0] for line in lines} == {"circled", "hatched", "grey", "letters"}
    assert "P previous-token, D duplicate-token, I induction" in legend.get_text()


def test_the_heatmap_can_be_read_as_the_readme_reads_it(tmp_path):
    """A type letter inside a circled dark cell could not be seen (L18H6's "I", the head
    the README names); ticks every third layer left L10 and L11 hard to tell apart;
    measured cells and estimated ones looked the same."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    from lm_eval_headloc.method.head_types import HeadTypes
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts
    from lm_eval_headloc.report.pages import plot_heatmap

    labels = [[None] * 9 for _ in range(30)]
    labels[18][6] = "induction"  # on the strongest head
    labels[2][1] = "previous_token"  # on a head that does nothing
    effects = np.zeros(270)
    effects[18 * 9 + 6], effects[1 * 9 + 4] = -0.3, -0.25
    measured = ["L18H6", "L1H4", "L0H0"]
    ranking = Ranking("t", "acc,none", True, 0.5, effects, list(np.argsort(effects)), 9,
                      facts=RankingFacts(confirmed=measured),
                      head_types=HeadTypes({"scores": {}, "dominant": labels}))
    figure = plot_heatmap([ranking], 2, tmp_path / "heatmap.png")
    ax = figure.axes[0]
    assert list(ax.get_yticks()) == list(range(30)) or \
        [t for t in ax.get_yticks() if 0 <= t <= 29] == list(range(30))
    letters = {t.get_text(): t for t in ax.texts}
    assert to_rgb(letters["I"].get_color()) == (1.0, 1.0, 1.0)  # light on the dark cell
    assert to_rgb(letters["P"].get_color()) != (1.0, 1.0, 1.0)
    boxes = sorted((round(p.get_x() + 0.42), round(p.get_y() + 0.42)) for p in ax.patches
                   if isinstance(p, Rectangle) and p.get_gid() == "measured")
    assert boxes == [(0, 0), (4, 1), (6, 18)]  # (head, layer) of each measured alone
    assert "boxed: measured alone" in _legend(figure)


def test_the_heatmap_does_not_circle_a_harmless_top_k_head_as_a_find(tmp_path):
    """A top-3 whose 3rd head does no harm (the report: 'the other places are filled by
    heads that do not') circled it like the others, and, never hatched, it read as a
    stable find."""
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import plot_heatmap

    effects = np.zeros(8)
    effects[5], effects[1] = -0.3, -0.1  # L1H1 and L0H1 hurt; the rest do nothing
    ranking = Ranking("t", "acc,none", True, 0.5, effects, [5, 1, 2, 0, 3, 4, 6, 7], 4)
    assert [str(h) for h in ranking.harmless(3)] == ["L0H2"]
    figure = plot_heatmap([ranking], 3, tmp_path / "heatmap.png")
    marks: dict[str, list] = {}
    for mark in figure.axes[0].collections:
        marks.setdefault(mark.get_gid(), []).extend(
            tuple(map(int, xy)) for xy in mark.get_offsets())
    assert sorted(marks["top"]) == [(1, 0), (1, 1)]  # (head, layer) of L0H1 and L1H1
    assert marks["harmless"] == [(2, 0)]
    assert "dashed circle: a top-3 place filled by a head that does not hurt" in _legend(
        figure)


@pytest.mark.parametrize(("n", "said"), [
    (1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (5, "5th"), (10, "10th"), (11, "11th"),
    (12, "12th"), (13, "13th"), (21, "21st"), (22, "22nd"), (23, "23rd"), (101, "101st"),
    (111, "111th"), (112, "112th"), (113, "113th")])
def test_ordinals_are_english(n, said):
    from lm_eval_headloc.common.words import ordinal

    assert ordinal(n) == said


@pytest.mark.parametrize(("top_k", "said"), [(3, "3rd"), (1, "1st"), (22, "22nd")])
def test_the_certificate_says_the_kth_place_as_an_ordinal(top_k, said):
    """``--top-k 3`` printed 'tied at the 3th place'."""
    from lm_eval_headloc.method.ranking import CertificateRecord, Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import certificate_line, certificate_words

    cert = CertificateRecord(
        certified=True, rule="r", confidence=0.95, entry_bar=0.2, top_k=top_k,
        measured_alone=4, ruled_out=4, bound=0.1, unchecked=[], unchecked_never_in_a_mask=0,
        unchecked_in_one_mask=0, unchecked_beside_measured=[], tied_at_k=["L0H1", "L1H2"],
        group_size=2, group_tests_run=2, group_tests=[], group_tests_to_cover=0)
    effects = -np.linspace(0.5, 0.1, 8)
    ranking = Ranking("t", "acc", True, 0.5, effects, list(range(8)), 4,
                      facts=RankingFacts(certificate=cert))
    line = certificate_line(ranking)
    words = " ".join(certificate_words(ranking))
    assert f"tied at the {said} place within the noise: L0H1, L1H2" in line
    assert f"tied at the {said} place: L0H1, L1H2" in words
    assert f"(the {said} largest measured alone)" in words
    assert f"{top_k}th" not in line + words or said.endswith("th")
    # The table shows the top-k, not every component measured alone: the file that does.
    assert "- measured alone: 4 heads (the table shows the top-" in words
    assert "`heads-t.csv`, `measured_alone` 1" in words and "the table's measured" not in words


def test_counts_of_one_are_said_in_the_singular():
    """A run left with one head unchecked printed 'not certified: 1 heads unchecked', and
    '--confirm 3' 'in 1 rounds of 5 (the last of 3)'."""
    from lm_eval_headloc.common.words import counted
    from lm_eval_headloc.method.ranking import CertificateRecord, Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import (
        _rounds_words,
        certificate_line,
        certificate_words,
        fit_summary,
    )

    assert [counted(n, "head") for n in (0, 1, 2)] == ["0 heads", "1 head", "2 heads"]
    assert counted(1, "MLP neuron", "MLP neurons") == "1 MLP neuron"
    cert = CertificateRecord(
        certified=False, rule="r", confidence=0.95, entry_bar=0.0, top_k=1,
        measured_alone=1, ruled_out=1, bound=0.1, unchecked=["L1H3"],
        unchecked_never_in_a_mask=1, unchecked_in_one_mask=0, unchecked_beside_measured=[],
        group_size=2, group_tests_run=1, group_tests=[], group_tests_to_cover=1,
        max_measurements=10, max_measurements_to_finish=12)
    effects = -np.linspace(0.5, 0.1, 8)
    ranking = Ranking("t", "acc", True, 0.5, effects, list(range(8)), 4,
                      facts=RankingFacts(certificate=cert, confirmed=["L0H0"], r2=0.5))
    line = certificate_line(ranking)
    words = " ".join(certificate_words(ranking))
    assert line.startswith("  not certified: 1 head unchecked (1 measured alone, 1 ruled out")
    assert "- measured alone: 1 head (" in words
    assert ("- ruled out by a mask or group test: 1 head; alone it harms the task by no more "
            "than 0.1 (the harm of the set that ruled it out, plus its margin)") in words
    assert "- **not checked: 1 head**: L1H3. Of them, 1 was never knocked out" in words
    assert ("a measured set that does not hurt the task at all (no head measured alone "
            "hurts it, so any harm would enter the top-1), rules out") in words
    assert "whose harm does not hurt" not in words
    assert " 1 heads" not in line + words and "fewer than 1" not in words
    assert fit_summary(ranking, 1) == ("; the top one measured alone: its place is measured, "
                                       "not fitted (the masks' fit: report.md)")
    assert _rounds_words([["L0H0", "L0H1", "L0H2"]], 5) == " in one round"
    assert _rounds_words([["L0H0"] * 5, ["L0H1"] * 3], 5) == " in 2 rounds of 5 (the last of 3)"


def test_group_test_line_counts_every_set_apart_from_their_sizes():
    """A default run's certificate read '21 sets of 16 heads at first, twice as many
    after ...' where 5 sets had 16 heads and the 21 counted the halves and the doubled ones
    too."""
    from lm_eval_headloc.method.ranking import (
        CertificateRecord,
        GroupTestRecord,
        Ranking,
        RankingFacts,
    )
    from lm_eval_headloc.report.locate_report import certificate_words

    def ranking_of(sizes: list[int], run: int = 1) -> Ranking:
        groups = [GroupTestRecord([f"L{i}H{j}" for j in range(size)], -0.01)
                  for i, size in enumerate(sizes)]
        cert = CertificateRecord(
            certified=True, rule="r", confidence=0.95, entry_bar=0.2, top_k=2,
            measured_alone=2, ruled_out=6, bound=0.1, unchecked=[],
            unchecked_never_in_a_mask=0, unchecked_in_one_mask=0,
            unchecked_beside_measured=[], group_size=16, group_tests_run=run,
            group_tests=groups, group_tests_to_cover=0)
        return Ranking("t", "acc", True, 0.5, -np.linspace(0.5, 0.1, 8), list(range(8)), 4,
                       facts=RankingFacts(certificate=cert, confirmed=["L0H0"]))

    def group_line(sizes: list[int], run: int) -> str:
        [line] = [w for w in certificate_words(ranking_of(sizes, run))
                  if w.startswith("- group tests")]
        return line

    doubled = group_line([16, 16, 8, 32, 4], run=6)
    [rule] = [w for w in certificate_words(ranking_of([16])) if w.startswith("Under the rule")]
    assert "a measured set whose harm stays under the top-2's entry bar, a harm of 0.2" in rule
    assert doubled.startswith(
        "- group tests (6 measurements: 5 sets, of 16 heads at first and of twice as many "
        "after a round whose new groups all ruled theirs out (up to 32), halved where ")
    assert group_line([16, 8], run=2).startswith(
        "- group tests (2 measurements: 2 sets, of up to 16 heads, halved where ")
    assert group_line([16], run=1).startswith(
        "- group tests (1 measurement: 1 set, of up to 16 heads, halved where ")


def test_the_spent_measurements_beside_a_cap_below_the_fixed_part():
    """On a model of 8 heads the auto cap is 4 while the prior, the masks and the heads
    measured alone take 28: the report read '28 measurement-equivalents ... of
    --max-measurements 4'."""
    from lm_eval_headloc.method.ranking import CertificateRecord, Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import certificate_words

    def spent_line(spent: int, cap: int, unit: str = "head", given: bool = False) -> str:
        cert = CertificateRecord(
            certified=True, rule="r", confidence=0.95, entry_bar=0.2, top_k=2,
            measured_alone=8, ruled_out=0, bound=None, unchecked=[],
            unchecked_never_in_a_mask=0, unchecked_in_one_mask=0,
            unchecked_beside_measured=[], group_size=16, group_tests_run=0, group_tests=[],
            group_tests_to_cover=0, measurements_spent=spent, max_measurements=cap)
        ranking = Ranking("t", "acc", True, 0.5, -np.linspace(0.5, 0.1, 8), list(range(8)),
                          4, facts=RankingFacts(certificate=cert, confirmed=["L0H0"]))
        [line] = [w for w in certificate_words(ranking, unit, cap_given=given)
                  if w.startswith("- measurements:")]
        return line

    over = spent_line(28, 4)
    assert "28 measurement-equivalents" in over and " of `--max-measurements 4`" not in over
    # The cap may be the automatic one: not said as an option the user gave.
    assert over.endswith(", more than the run's cap of 4 (`--max-measurements`; by default "
                         "half the heads it ranks): the prior, the masks and the heads "
                         "measured alone are spent whatever the cap, which stops only the "
                         "group tests")
    assert "(the prior's allowance, masks, heads measured alone and group tests)" in over
    neurons = spent_line(28, 4, "neuron")
    assert "heads" not in neurons and "neurons measured alone and group tests" in neurons
    assert spent_line(77, 135, given=True).endswith(" of `--max-measurements 135`")
    assert spent_line(135, 135, given=True).endswith(" of `--max-measurements 135`")
    # Under the automatic cap: not said as '--max-measurements 135', which no one gave.
    assert spent_line(77, 135).endswith(" of the run's automatic cap of 135 "
                                        "(`--max-measurements auto`: half the heads it ranks)")


def test_a_run_that_measured_nothing_alone_does_not_point_to_measured_changes():
    """With --confirm 0 the certificate said 'measured alone: 0 heads (the table shows the
    top-3; each one's measured change is in heads-t.csv, measured_alone 1)'."""
    from lm_eval_headloc.method.ranking import CertificateRecord, Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import certificate_words

    def alone_line(measured_alone: int, confirmed: list[str] | None) -> str:
        unchecked = [f"L0H{i}" for i in range(measured_alone, 8)]
        cert = CertificateRecord(
            certified=False, rule="r", confidence=0.95, entry_bar=0.0, top_k=3,
            measured_alone=measured_alone, ruled_out=0, bound=None, unchecked=unchecked,
            unchecked_never_in_a_mask=0, unchecked_in_one_mask=0,
            unchecked_beside_measured=[], group_size=2, group_tests_run=0, group_tests=[],
            group_tests_to_cover=4)
        ranking = Ranking("t", "acc", True, 0.5, -np.linspace(0.5, 0.1, 8), list(range(8)),
                          4, facts=RankingFacts(certificate=cert, confirmed=confirmed))
        [line] = [w for w in certificate_words(ranking) if w.startswith("- measured alone")]
        return line

    assert alone_line(0, None) == ("- measured alone: none (`--confirm 0`: every head ranks "
                                   "by the masks' fit)")
    assert alone_line(2, ["L0H0", "L0H1"]).startswith(
        "- measured alone: 2 heads (the table shows the top-3; each one's measured change "
        "is in `heads-t.csv`")


def test_sparsity_auto_says_when_no_level_kept_enough():
    """Where no pilot level kept the share, the smallest is chosen: the report said 'the
    largest whose pilot masks kept ≥ 50%' beside shares all under 50 %."""
    from types import SimpleNamespace

    from lm_eval_headloc.report.locate_report import _sparsity_words

    def run(kept):
        return SimpleNamespace(spec=SimpleNamespace(sparsity="auto", components="heads"),
                               pilot={"sparsity": 0.02, "keep_at_least": 0.5, "kept": kept})

    none_kept = _sparsity_words(run({"0.02": {"t": 0.3}, "0.05": {"t": 0.2}}))
    assert none_kept.startswith("auto: 0.02, the smallest tried: no level's pilot masks kept "
                                "50% of the score's distance to a mask of half the heads")
    assert none_kept.endswith("(p=0.02: 30%; p=0.05: 20%)")
    kept = _sparsity_words(run({"0.02": {"t": 0.7}, "0.05": {"t": 0.2}}))
    assert kept.startswith("auto: 0.02, the largest whose pilot masks kept ≥ 50% ")


def test_a_neuron_runs_words_and_legend_name_neurons_only(tmp_path):
    """A neurons run said 'No head stands out: all 3 listed heads' and its bar legend named
    blue heads it did not have."""
    from lm_eval_headloc.intervention.components import Neuron
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts
    from lm_eval_headloc.report.pages import plot_heatmap, tie_words

    neurons = [Neuron(layer, n) for layer in range(2) for n in range(3)]
    columns = Columns(tuple(neurons))
    names = [str(c) for c in neurons]
    ranking = Ranking("t", "acc", True, 0.5, np.zeros(6), list(range(6)), 4,
                      facts=RankingFacts(tied_with_above=names[1:],
                                         method="compressed sensing (Lasso)"),
                      columns=columns)
    [said, _] = tie_words(ranking, 3)
    assert said == ("No neuron stands out: all 3 listed MLP neurons have the same evidence "
                    "(the fit found no effect that tells the MLP neurons apart); their order "
                    "is the index.")
    # A tie across the last place: with the neurons below it, listed in neuron order.
    ranking.facts.tied_with_above = [names[3]]
    assert tie_words(ranking, 3)[0] == (
        "Tied (the same evidence; listed in neuron order): L0N2 = L1N0 (the last place is "
        "shared with MLP neurons below it).")
    figure = plot_heatmap([ranking], 3, tmp_path / "heatmap.png")
    legend = _legend(figure)
    assert "red, MLP neurons" in legend and "heads" not in legend
    # The bars are the colour the legend names.
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    bars = {to_rgb(p.get_facecolor()) for ax in figure.axes for p in ax.patches
            if isinstance(p, Rectangle)}
    assert bars == {to_rgb("tab:red")}


@pytest.mark.parametrize(("value", "said"), [
    (-0.0, "+0.0000"), (0.0, "+0.0000"), (-4e-6, "+0.0000"), (4e-6, "+0.0000"),
    (-0.00005001, "-0.0001"), (0.125, "+0.1250"), (-1.5, "-1.5000")])
def test_signed_numbers_never_read_minus_zero(value, said):
    from lm_eval_headloc.common.words import signed

    assert signed(value) == said


def test_a_fits_signed_zeros_read_as_zero_in_the_table():
    """A Lasso's zero is -0.0 where the sign is flipped: refit printed 103 lines of
    'L6H7  -0.0000  (does not hurt)', report.md '[-0.0000, +0.0000]' intervals, and
    one bootstrap refit was 'in 1 bootstrap refits'."""
    from lm_eval_headloc.method.lasso import Stability
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import ranking_table

    effects = np.array([-0.3, -0.0, -0.0, -1e-7])
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 1, 2, 3], 2,
                      stability=Stability(np.array([1.0, 0, 0, 0]), np.array([-0.4, -0.0,
                                          -2e-6, -0.0]), np.array([-0.2, 0.0, -0.0, 0.0]), 1))
    assert str(ranking.effects[1]) == "0.0"  # the ranking keeps no signed zero
    table = "\n".join(ranking_table(ranking, 4, "change"))
    assert "-0.0000" not in table and table.count("[+0.0000, +0.0000]") == 3
    assert "in top-4, hurting, in 1 bootstrap refit |" in table


@pytest.mark.parametrize(("settings", "said"), [
    ({}, "output is zeroed (--ablation zero, --scale 0)"),
    ({"scale": 2.0}, "output is multiplied by 2 (--ablation zero, --scale 2)"),
    ({"ablation": "mean", "scale": 2.0},
     "mean ablation: a knocked-out neuron's output z becomes r + 2·(z − r), r its mean over "
     "the reference set, the run's tasks on its example subset (--ablation mean, --scale 2)"),
    ({"ablation": "resample", "ablation_data": "ref.jsonl", "ablation_field": "body"},
     "resample ablation: a knocked-out neuron's output is replaced by its output on another "
     "example of the reference set, `ref.jsonl`'s field body (--ablation resample, --scale 0)"),
])
def test_the_report_says_what_a_knockout_did(settings, said):
    """locate's report.md named neither --ablation nor --scale: a run by mean ablation at
    scale 2 read as one of zeroed heads."""
    from lm_eval_headloc.report.pages import knockout_words
    from lm_eval_headloc.runs.spec import RunSpec

    line = knockout_words(RunSpec(**settings), "neuron")
    assert line.startswith("- knockout: ") and line.endswith(said)


def test_bars_of_estimates_are_outlined_beside_measured_ones(tmp_path):
    """A run's top list drew a fit's estimates (0.24) as filled bars longer than heads
    measured alone (0.20): they read as measurements."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    from lm_eval_headloc.intervention.components import Head, Neuron
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts
    from lm_eval_headloc.report.pages import plot_heatmap

    columns = Columns((Head(0, 0), Head(0, 1), Neuron(0, 3), Neuron(1, 2)))
    ranking = Ranking("t", "acc", True, 0.5, np.array([-0.2, -0.24, -0.1, -0.05]),
                      [0, 1, 2, 3], 2, columns=columns,
                      facts=RankingFacts(confirmed=["L0H0", "L0N3"]))
    figure = plot_heatmap([ranking], 2, tmp_path / "heatmap.png")
    bars = [p for ax in figure.axes for p in ax.patches if isinstance(p, Rectangle)
            and p.get_width() > 0]
    fills = {round(p.get_width(), 2): to_rgb(p.get_facecolor()) for p in bars}
    assert fills[0.2] == to_rgb("tab:blue") and fills[0.1] == to_rgb("tab:red")
    assert fills[0.24] == fills[0.05] == (1.0, 1.0, 1.0)  # the estimates: outlined
    assert "outlined, the fit's estimate (not measured alone)" in _legend(figure)
    # Nothing measured alone: no bar is outlined, and the legend says nothing of it.
    ranking.facts.confirmed = None
    figure = plot_heatmap([ranking], 2, tmp_path / "heatmap.png")
    assert "outlined" not in _legend(figure)
