"""Upstream's grad scaler pages (API_grad_scaler, UserGuide_BasicUsage_grad_scaler) on our
roundpipe.GradScaler, against torch.amp.GradScaler and plain torch.

fp32 numbers: relative 1e-5 (plus an absolute floor of 1e-6); fp16 models: loose bounds (fp16
forward). Every injected overflow must skip the step, lower the scale as torch's rule does, and
leave a WARNING record on the "roundpipe" logger.
"""

import copy
import logging
import threading

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import GradScaler, OptimizerCtx  # noqa: E402
from roundpipe.optim import Adam  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
N_MB = 3
BATCH = 12


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data(it):
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def mse(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def assert_weights(model, ref, rtol=RTOL, atol=ATOL):
    model.synchronize()
    for (name, p), q in zip(model.optim_named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=name)


def skip_records(caplog):
    return [r for r in caplog.records if r.name == "roundpipe" and r.levelno >= logging.WARNING
            and ("skipped" in r.getMessage() or "did not run" in r.getMessage())]


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_sync_schedule_and_weights_match_torch_amp(caplog, skip_nonfinite):
    """step(is_async=False) + update(is_async=False): torch.amp.GradScaler's schedule exactly;
    an injected inf (iteration 3) skips the step, halves the scale and is logged."""
    ref = net()
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2),
                                skip_nonfinite_steps=skip_nonfinite)
    with OptimizerCtx():
        opt = Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=1024.0, growth_interval=2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    caplog.set_level(logging.WARNING, logger="roundpipe")
    for it in range(7):
        x, y = data(it)
        bad = it == 3

        def loss_fn(out, lbl, bad=bad):
            loss = mse(out, lbl) * (float("inf") if bad else 1.0)
            return scaler.scale(loss) / N_MB
        scale_used = scaler.get_scale()
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update(is_async=False)

        ref_loss = mse(ref(x), y) * (float("inf") if bad else 1.0)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), it
        if not bad:  # the returned loss is the scaled one: loss / scale is the real loss
            assert float(loss) / scale_used == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert_weights(model, ref)
    assert len(skip_records(caplog)) >= 1
    model.close()


def test_async_schedule_is_torch_amp_one_iteration_late(caplog):
    """Default asynchronous steps and update(): a skipped step lowers the scale at the next
    update() (upstream: "takes effect on the next call to update()"): the scale after update t
    is torch.amp's after update t - 1."""
    bad_iters = {2, 5}
    iters = 9
    model = roundpipe.RoundPipe(net(), devices=("cpu", 2))
    opt = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=256.0, growth_interval=2)
    caplog.set_level(logging.WARNING, logger="roundpipe")
    ours = []
    for it in range(iters):
        x, y = data(it)
        factor = float("inf") if it in bad_iters else 1.0
        model.forward_backward((x,), label=y,
                               loss_fn=lambda o, l, f=factor: scaler.scale(mse(o, l) * f) / N_MB)
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        ours.append(scaler.get_scale())
    model.synchronize()
    # torch.amp on the same overflow pattern
    p = torch.nn.Parameter(torch.ones(1))
    ref_opt = torch.optim.SGD([p], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    expected = []
    for it in range(iters):
        ref.scale((p * (float("inf") if it in bad_iters else 1.0)).sum()).backward()
        ref.step(ref_opt)
        ref_opt.zero_grad()
        ref.update()
        expected.append(ref.get_scale())
    assert ours == [256.0] + expected[:-1]
    assert len(skip_records(caplog)) >= len(bad_iters)
    model.close()


def test_unscale_and_clip_grad_norm_inside_step_fn():
    """The user guide's manual unscaling: unscale_ + clip_grad_norm_ + step in step_fn."""
    ref = net(1)
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    with OptimizerCtx():
        opt = Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=4096.0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    norms = []

    def step_fn():
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"],
                                                          max_norm=0.05)))
        scaler.step(opt)
        opt.zero_grad()

    for it in range(4):
        x, y = data(it)
        model.forward_backward((x,), label=y, loss_fn=lambda o, l: scaler.scale(mse(o, l)) / N_MB)
        model.step(step_fn, is_async=False)
        scaler.update(is_async=False)
        ref_scaler.scale(mse(ref(x), y)).backward()
        ref_scaler.unscale_(ref_opt)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05))
        assert norms[-1] == pytest.approx(ref_norm, rel=1e-5)
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
    assert max(norms) > 0.05  # clipping was active
    assert_weights(model, ref)
    model.close()


def test_step_fn_unscales_with_its_own_scale():
    """An async step that runs after update() changed the scale still sees the scale its
    gradients were made with (get_scale() on the optimizer thread)."""
    model = roundpipe.RoundPipe(net(), devices=("cpu", 1))
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    scaler = GradScaler(init_scale=8.0)
    go = threading.Event()
    seen = []

    def step_fn():
        go.wait(10)
        seen.append(scaler.get_scale())
        scaler.step(opt)
        opt.zero_grad()

    x, y = data(0)
    model.forward_backward((x,), label=y, loss_fn=lambda o, l: scaler.scale(mse(o, l)))
    model.step(step_fn)
    scaler.update(new_scale=2.0)
    go.set()
    model.synchronize()
    assert seen == [8.0]
    assert scaler.get_scale() == 2.0
    model.close()


@pytest.mark.parametrize("engine_scaler", [None, False])
def test_fp16_overflow_skips_step_halves_scale_and_warns(caplog, engine_scaler):
    """Upstream's fp16 loop (model in float16, fp32 optimizer, GradScaler, async steps). With
    the engine's own fp16 scaler on (default) or off, an injected overflow skips the step,
    halves the scale (at the next update()) and is logged; training goes on and the real loss
    (loss / get_scale()) matches the fp32 loss."""
    ref = net(2)
    model = roundpipe.RoundPipe(copy.deepcopy(ref).to(torch.float16), optim_dtype=torch.float32,
                                devices=("cpu", 2), grad_scaler=engine_scaler)
    assert (model.grad_scale[0] > 0) == (engine_scaler is None)
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=1e-3)
    scaler = GradScaler()
    caplog.set_level(logging.WARNING, logger="roundpipe")
    scales, real = [], []
    for it in range(6):
        x, y = data(it)
        boost = 1e6 if it == 2 else 1.0  # fp16 gradients overflow at this scale
        loss = model.forward_backward(
            input_args=(x.to(torch.float16),), label=y,
            loss_fn=lambda outputs, labels, b=boost: scaler.scale(mse(outputs, labels) * b)
            / N_MB)
        scale_used = scaler.get_scale()
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()
        scales.append(scaler.get_scale())
        real.append(loss.item() / scale_used / boost)
    model.synchronize()
    assert scales[:3] == [65536.0] * 3 and scales[3:] == [32768.0] * 3
    assert len(skip_records(caplog)) >= 1
    assert all(torch.isfinite(torch.tensor(real)))
    x, y = data(0)
    assert real[0] == pytest.approx(float(mse(ref(x), y)), rel=2e-2)
    for p in model.optim_parameters():
        assert torch.isfinite(p).all()
    model.close()


def test_scale_tensors_iterables_and_disabled():
    scaler = GradScaler(init_scale=4.0)
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(scaler.scale(t), t * 4)
    pair = scaler.scale((t, 2 * t))
    assert isinstance(pair, tuple) and torch.equal(pair[1], t * 8)
    assert [torch.equal(a, b) for a, b in zip(scaler.scale([t]), [t * 4])] == [True]
    with pytest.raises(ValueError):
        scaler.scale(3.0)
    off = GradScaler(enabled=False)
    assert off.scale(t) is t and off.get_scale() == 1.0 and not off.is_enabled()
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.5)
    assert off.step(opt) is None
    off.update()
    assert torch.equal(p.detach(), torch.full((2,), 0.5)) and off.state_dict() == {}


def test_state_dict_getters_setters_and_torch_compat():
    scaler = GradScaler(init_scale=128.0, growth_factor=3.0, backoff_factor=0.25,
                        growth_interval=7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (3.0, 0.25, 7)
    assert scaler.get_growth_factor(up_to_date=True) == 3.0
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.5)
    scaler.set_growth_interval(3)
    state = scaler.state_dict()
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(state)
    assert torch_scaler.get_scale() == 128.0 and torch_scaler.get_growth_interval() == 3
    other = GradScaler()
    other.load_state_dict(torch_scaler.state_dict())
    assert other.state_dict() == state
    with pytest.raises(RuntimeError):
        other.load_state_dict({})
    other.update(new_scale=torch.tensor(16.0))
    assert other.get_scale() == 16.0
    with pytest.raises(ValueError):
        GradScaler(growth_factor=0.5)


def test_plain_torch_loop_behaves_as_torch_amp():
    """Outside RoundPipe (main thread only) it is torch.amp.GradScaler."""
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 2)
    b = copy.deepcopy(a)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    sa = GradScaler(init_scale=64.0, growth_interval=1)
    sb = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1)
    for it in range(4):
        x = torch.randn(3, 4) * (float("inf") if it == 1 else 1.0)
        for s, m, o in ((sa, a, oa), (sb, b, ob)):
            s.scale(m(x).pow(2).sum()).backward()
            s.step(o)
            o.zero_grad()
            s.update()
        assert sa.get_scale() == sb.get_scale()
    torch.testing.assert_close(a.weight, b.weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_step_fn_always_runs_once_a_grad_scaler_serves_the_model(caplog, dtype):
    """Upstream: step_fn always runs and scaler.step(optimizer) skips optimizer.step() on an
    overflow. The first step served by a GradScaler switches the engine's loss scaler (on by
    default for fp16) and its skip_nonfinite_steps rule (on by default) off on the live model;
    an overflow later runs step_fn, leaves the weights bitwise unchanged, is logged by the
    GradScaler and halves its scale at update()."""
    model = roundpipe.RoundPipe(net(4).to(dtype), optim_dtype=torch.float32,
                                devices=("cpu", 1))
    assert (model.grad_scale[0] > 0) == (dtype == torch.float16)
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=256.0)
    caplog.set_level(logging.WARNING, logger="roundpipe")
    ran = []

    def step_fn():
        ran.append(True)
        scaler.step(optimizer)
        optimizer.zero_grad()

    for it in range(4):
        x, y = data(it)
        poison = float("inf") if it == 2 else 1.0
        model.forward_backward(
            input_args=(x.to(dtype),), label=y,
            loss_fn=lambda o, l, p=poison: scaler.scale(mse(o.float(), l) * p) / N_MB)
        if it == 2:
            model.synchronize()
            before = [p.detach().clone() for p in model.optim_parameters()]
        model.step(step_fn, is_async=False)
        scaler.update()
        if it == 0:
            assert model.grad_scale[0] == 0.0  # handed over: the engine no longer scales
        if it == 2:
            model.synchronize()
            for p, b in zip(model.optim_parameters(), before):
                assert torch.equal(p.detach(), b)
            assert scaler.get_scale() == 128.0
    assert len(ran) == 4  # every step_fn ran, the overflowing one included
    assert any("optimizer.step() skipped" in r.getMessage() for r in caplog.records)
    assert model.nonfinite_counts()[1] == 0  # the engine skipped nothing itself
    model.close()
