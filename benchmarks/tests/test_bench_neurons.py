"""benchmarks/bench_neurons.py's evidence table: what stands behind each top-5, read from the
runs' ranking files (worked out by hand on a written ranking)."""

from __future__ import annotations

import json

from headloc_bench import bench_neurons


def test_top_evidence_sorts_each_top_5_by_what_stands_behind_it(tmp_path):
    bench = bench_neurons
    entries = [{"neuron": "L0N1", "effect": -0.2, "measured_alone": True},
               {"neuron": "L0N2", "effect": -0.1, "measured_alone": False},
               {"group": "L1G0", "effect": -0.05, "measured_alone": False},
               {"neuron": "L0N3", "effect": 0.0, "measured_alone": True},
               {"neuron": "L0N4", "effect": 0.03, "measured_alone": False},
               {"neuron": "L0N5", "effect": -0.3, "measured_alone": True}]  # rank 6: out
    for method in ("heads", "neurons"):
        for part in (1, 2):
            folder = tmp_path / "t" / f"{method}-p{part}"
            folder.mkdir(parents=True)
            (folder / "heads-t.json").write_text(json.dumps({
                "higher_is_better": part == 1, "heads": entries,
                "same_masks": {"L0N2": ["L0N7", "L0N8"]}}))
    found = bench.top_evidence(tmp_path, "t")
    # Higher is better: a negative change hurts.
    assert found["neurons"][1] == {"measured": ["L0N1"], "estimated": ["L0N2", "L1G0"],
                                   "same_masks": {"L0N2": 2}, "no_harm": ["L0N3", "L0N4"]}
    # Lower is better: only the positive change hurts, and it was not measured.
    assert found["heads"][2]["measured"] == [] and found["heads"][2]["estimated"] == ["L0N4"]
    table = "\n".join(bench.evidence_lines(found))
    assert "| neurons | 1 | 1 | L0N2 (× 2), L1G0 | L0N3, L0N4 |" in table
