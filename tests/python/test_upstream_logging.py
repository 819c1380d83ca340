"""Upstream's pages API_logging and "Logging and Profiling" (UserGuide_AdvancedUsage_logging):
``roundpipe.timer.ModelTimer.VERBOSE`` prints per-layer timings to stderr after each iteration,
``Layer {i} {action}  new record: {t:.3f} ms  new estimate: {t:.3f} ms``.

The timings are the engine's (rp_model_trace_json, read back here independently); the engine
times stages, so one-layer stages give upstream's per-layer lines, and a stage of several layers
is one "Layer a-b" line; recompute is timed with backward ("bwd"), the fused last stage of
forward_backward() is "tail" (roundpipe/timer.py)."""

import re

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import RoundPipe  # noqa: E402
from roundpipe.timer import ModelTimer  # noqa: E402

DEVICES = ("cpu", 2)
LINE = re.compile(r"^Layer (\d+(?:-\d+)?) (fwd|bwd|tail)\s+new record: (\d+\.\d{3}) ms  "
                  r"new estimate: (\d+\.\d{3}) ms$")


@pytest.fixture
def verbose():
    ModelTimer.VERBOSE = True
    try:
        yield
    finally:
        ModelTimer.VERBOSE = False


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 4))


def loss_fn(out, label):
    return ((out - label) ** 2).sum()


def engine_means(trace):
    """(stage, kind) -> mean compute event duration in ms, straight from the trace."""
    sums = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            key = (e["args"]["stage"], e["args"]["kind"])
            total, count = sums.get(key, (0.0, 0))
            sums[key] = (total + e["dur"] / 1000.0, count + 1)
    return {k: t / c for k, (t, c) in sums.items()}


def parsed(err):
    lines = [line for line in err.splitlines() if line.startswith("Layer ")]
    out = []
    for line in lines:
        m = LINE.match(line)
        assert m, "not upstream's format: %r" % line
        out.append((m.group(1), m.group(2), float(m.group(3)), float(m.group(4))))
    return out


def test_verbose_is_a_class_flag_off_by_default():
    assert ModelTimer.VERBOSE is False
    assert roundpipe.ModelTimer is ModelTimer


def test_nothing_is_printed_when_not_verbose(capsys):
    with RoundPipe(net(), devices=DEVICES, stage_plan=[1, 1, 1, 1]) as model:
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 4), loss_fn=loss_fn)
    assert "Layer " not in capsys.readouterr().err


def test_verbose_prints_one_line_per_layer_and_action_with_the_engines_times(capsys, verbose):
    with RoundPipe(net(), devices=DEVICES, stage_plan=[1, 1, 1, 1]) as model:
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 4), loss_fn=loss_fn)
        lines = parsed(capsys.readouterr().err)
        means = engine_means(model.trace())
        # stages 0..2 forward and backward, stage 3 the fused tail
        assert sorted((layer, action) for layer, action, _, _ in lines) == sorted(
            [(str(i), "fwd") for i in range(3)] + [(str(i), "bwd") for i in range(3)]
            + [("3", "tail")])
        kinds = {"fwd": "forward", "bwd": "backward", "tail": "tail"}
        first = {}
        for layer, action, record, estimate in lines:
            want = means[(int(layer), kinds[action])]
            assert record == pytest.approx(want, abs=1e-3)
            assert estimate == record  # the first record is the estimate
            first[(layer, action)] = estimate
        # the next iteration: the estimate is the moving average of the records
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 4), loss_fn=loss_fn)
        lines = parsed(capsys.readouterr().err)
        means = engine_means(model.trace())
        assert len(lines) == 7
        s = ModelTimer.SMOOTHING
        timer = ModelTimer.of(model)
        for layer, action, record, estimate in lines:
            assert record == pytest.approx(means[(int(layer), kinds[action])], abs=1e-3)
            assert estimate == pytest.approx((1 - s) * first[(layer, action)] + s * record,
                                             abs=2e-3)
            exact = timer.estimate(range(int(layer), int(layer) + 1), action)
            assert exact == pytest.approx(estimate, abs=1e-3)


def test_forward_prints_forward_times_and_stages_of_several_layers(capsys, verbose):
    with RoundPipe(net(), devices=DEVICES, stage_plan=[2, 2]) as model:
        with torch.no_grad():
            model(torch.randn(6, 8))
        lines = parsed(capsys.readouterr().err)
        assert [(layer, action) for layer, action, _, _ in lines] == [("0-1", "fwd"),
                                                                      ("2-3", "fwd")]
        means = engine_means(model.trace())
        for (layer, _, record, _), stage in zip(lines, (0, 1)):
            assert record == pytest.approx(means[(stage, "forward")], abs=1e-3)


def test_update_reads_the_last_call_without_verbose(capsys):
    with RoundPipe(net(), devices=DEVICES, stage_plan=[1, 3]) as model:
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 4), loss_fn=loss_fn)
        records = ModelTimer.of(model).update()
        assert [(r.label, r.action) for r in records] == [("0", "fwd"), ("0", "bwd"),
                                                          ("1-3", "tail")]
        assert all(r.record_ms >= 0 for r in records)
        assert ModelTimer.of(model) is ModelTimer.of(model)
    assert "Layer " not in capsys.readouterr().err
