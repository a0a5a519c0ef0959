"""The goodput simulator against closed forms, against the paper's table, and for reproducibility."""

import numpy as np
import pytest

from ddiloco.simulate import goodput as gp

DAY = 86400.0


def rows_by_key(rows):
    return {(r.method, r.learners, r.chips): r for r in rows}


@pytest.mark.parametrize(
    ("spec", "mean"),
    [
        ("const:78.5", 78.5),
        ("exp:60", 60.0),
        ("lognormal:100,0.5", 100 * np.exp(0.125)),
        ("uniform:10,30", 20.0),
    ],
)
def test_distribution_parse_and_mean(spec, mean):
    d = gp.Distribution.parse(spec)
    assert d.spec() == spec
    assert d.mean == pytest.approx(mean)
    sample = d.sample(np.random.default_rng(0), 200_000)
    assert (sample >= 0).all()
    assert sample.mean() == pytest.approx(mean, rel=0.02)


@pytest.mark.parametrize(
    "spec", ["const", "exp:", "weibull:3", "lognormal:1", "const:-1", "uniform:5,1", "exp:x"]
)
def test_distribution_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        gp.Distribution.parse(spec)


@pytest.mark.parametrize("repair", ["const:78.5", "exp:78.5", "lognormal:60,0.7"])
def test_data_parallel_matches_renewal_closed_form(repair):
    # Renewal reward: 1 / (1 + N·λ·E[repair + restart]) for any repair distribution.
    model = gp.FailureModel(repair=gp.Distribution.parse(repair), restart=gp.Distribution.const(10.0))
    row = gp.simulate_dp(300_000, model, 60 * DAY, np.random.default_rng(1))
    assert row.goodput == pytest.approx(gp.closed_form("dp", 300_000, 1, model), abs=0.01)
    assert row.uptime == row.goodput
    expected_failures = 60 * DAY * row.goodput * 300_000 * model.chip_rate
    assert row.failures == pytest.approx(expected_failures, rel=0.05)


def test_elastic_matches_closed_form_with_constant_repair():
    # One chip type, constant repair: (1 - f) / (1 + n·λ·(1 - f)·pause), f = λS·R / (1 + λS·R).
    model = gp.FailureModel(slice_chips=9375, repair=gp.Distribution.const(600.0))
    rows = rows_by_key(gp.simulate_chips(1_200_000, [4], model, 30 * DAY, seed=3))
    for key in [("elastic_dp", 1, 1_200_000), ("decoupled", 4, 1_200_000)]:
        expected = gp.closed_form(key[0], key[2], key[1], model)
        assert rows[key].goodput == pytest.approx(expected, abs=0.01)


def test_one_slice_learners_lose_exactly_their_down_time():
    # A learner of one slice with pause < repair: the pause hides inside the outage, so goodput is the
    # slice's availability 1 / (1 + λS·R) (alternating renewal), and some learner always trains.
    model = gp.FailureModel(slice_chips=10_000, repair=gp.Distribution.const(3600.0))
    rows = rows_by_key(gp.simulate_chips(160_000, [16], model, 60 * DAY, seed=0))
    availability = 1 / (1 + model.chip_rate * 10_000 * 3600.0)
    assert rows[("decoupled", 16, 160_000)].goodput == pytest.approx(availability, abs=0.003)
    assert rows[("decoupled", 16, 160_000)].uptime == pytest.approx(1.0, abs=1e-6)


def test_no_failures_means_full_goodput():
    model = gp.FailureModel(mtbf_years=1e9)
    for row in gp.simulate_chips(150_000, [2], model, 10 * DAY):
        assert row.goodput == pytest.approx(1.0, abs=1e-6)
        assert row.uptime == pytest.approx(1.0, abs=1e-6)
        assert row.paper is None  # the paper's table is for MTBF 1 year only


def test_lost_step_adds_half_a_step_per_failure():
    model = gp.FailureModel(step_seconds=40.0)
    row = gp.simulate_dp(600_000, model, 60 * DAY, np.random.default_rng(2))
    assert row.goodput == pytest.approx(gp.closed_form("dp", 600_000, 1, model), abs=0.01)
    assert gp.closed_form("dp", 600_000, 1, model) < gp.closed_form("dp", 600_000, 1, gp.FailureModel())


def test_seeded_runs_are_reproducible():
    model = gp.FailureModel(repair=gp.Distribution.parse("exp:78.5"))
    a = gp.simulate_grid([300_000], [2, 8], model, 5 * DAY, seed=7)
    b = gp.simulate_grid([300_000], [2, 8], model, 5 * DAY, seed=7)
    c = gp.simulate_grid([300_000], [2, 8], model, 5 * DAY, seed=8)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.to_dict() for r in a] != [r.to_dict() for r in c]
    # A cell does not depend on which other learner counts were asked for.
    alone = rows_by_key(gp.simulate_grid([300_000], [8], model, 5 * DAY, seed=7))
    assert alone[("decoupled", 8, 300_000)] == rows_by_key(a)[("decoupled", 8, 300_000)]


def test_calibration_uses_only_data_parallel_rows_and_gives_the_defaults():
    chips = gp.PAPER_CHIPS
    dp = [v / 100 for v in gp.PAPER_GOODPUT[("dp", 1)]]
    elastic = [v / 100 for v in gp.PAPER_GOODPUT[("elastic_dp", 1)]]
    c = gp.calibrate(chips, dp, elastic, slice_chips=9375)
    default = gp.FailureModel()
    assert c.repair_seconds == pytest.approx(default.repair.mean)
    assert c.restart_seconds == pytest.approx(default.restart.mean)
    assert c.reconfig_seconds == pytest.approx(default.reconfig.mean)
    assert c.rms_points < 2.5
    # The fit recovers parameters it generated data from.
    const = gp.Distribution.const
    truth = gp.FailureModel(repair=const(40.0), restart=const(30.0), reconfig=const(12.0))
    fake_dp = [gp.closed_form("dp", n, 1, truth) for n in chips]
    fake_el = [gp.closed_form("elastic_dp", n, 1, truth) for n in chips]
    fit = gp.calibrate(chips, fake_dp, fake_el, slice_chips=9375)
    assert (fit.repair_seconds, fit.restart_seconds, fit.reconfig_seconds) == pytest.approx(
        (40, 30, 12), abs=0.5
    )


def test_default_model_reproduces_the_paper_table():
    rows = gp.simulate_grid(gp.PAPER_CHIPS, [2, 4, 8, 16], gp.FailureModel(), 30 * DAY, seed=0)
    assert len(rows) == 30
    for r in rows:
        assert r.paper is not None
        tolerance = 0.03 if r.chips == 1_200_000 else 0.05
        assert abs(r.goodput - r.paper) <= tolerance, r
    by = rows_by_key(rows)
    for n in gp.PAPER_CHIPS:
        ladder = [by[("dp", 1, n)], by[("elastic_dp", 1, n)]] + [
            by[("decoupled", m, n)] for m in (2, 4, 8, 16)
        ]
        assert [r.goodput for r in ladder] == sorted(r.goodput for r in ladder)
        assert by[("decoupled", 8, n)].uptime > 0.999  # training never stops


def test_too_many_learners_for_the_slices_is_an_error():
    with pytest.raises(ValueError, match="at least one 9375-chip slice"):
        gp.simulate_chips(150_000, [32], gp.FailureModel(), DAY)


def test_interval_helpers():
    s, e = gp._union(np.array([5.0, 0.0, 1.0, 10.0]), np.array([6.0, 2.0, 3.0, 11.0]))
    assert s.tolist() == [0.0, 5.0, 10.0]
    assert e.tolist() == [3.0, 6.0, 11.0]
    a = (np.array([0.0, 10.0]), np.array([5.0, 20.0]))
    b = (np.array([3.0]), np.array([12.0]))
    assert gp._measure_all_covered([a, b]) == pytest.approx(2.0 + 2.0)
    t = np.array([0.0, 1.0, 2.5, 3.0, 10.0])
    assert gp._pause_starts(t, np.full(5, 2.0)).tolist() == [0, 2, 4]
