"""Errors surface as RoundPipeError with the engine's message (or as the user's own exception
when a user callback failed), and the model stays usable afterwards."""

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import (RoundPipeError, RoundPipeRunConfig, RoundPipeUnsupportedError,  # noqa: E402
                       Status)
from rp_reference import MLP_SPEC, microbatch_grads, torch_mlp, torch_model_like  # noqa: E402

DEVICES = ("cpu", 2)
N_MB = 3


@pytest.fixture
def model():
    m = roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES, seed=1)
    yield m
    m.close()


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def test_bad_spec_names_the_layer():
    spec = {"layers": [{"type": "linear", "in": 4, "out": 8}, {"type": "relu"},
                       {"type": "linear", "in": -3, "out": 2}]}
    with pytest.raises(RoundPipeError) as info:
        roundpipe.RoundPipe(spec, devices=DEVICES)
    err = info.value
    assert err.status == Status.INVALID_ARGUMENT
    assert "layer 2 (linear)" in err.message
    assert err.message in str(err)


@pytest.mark.parametrize("spec", [
    '{"layers": [{"type": "linear", "in": 4, "out": 8, "bais": false}]}',  # typo: unknown key
    '{"layers": [{"type": "convolution"}]}',
    '{"layers": [',
    '{"layers": []}',
])
def test_bad_specs_are_invalid_arguments(spec):
    with pytest.raises(RoundPipeError) as info:
        roundpipe.RoundPipe(spec, devices=DEVICES)
    assert info.value.status == Status.INVALID_ARGUMENT
    assert info.value.message


def test_bad_inputs_raise_and_leave_the_model_usable(model):
    x, y = batch()
    before = model(x)
    with pytest.raises(RoundPipeError) as info:
        model(torch.randn(6, 5))  # wrong feature size
    assert info.value.status == Status.INVALID_ARGUMENT and info.value.message
    # The shape is said with a microbatch's rows (6 rows in 3 microbatches), not the empty
    # batch the engine checks on.
    with pytest.raises(RoundPipeError) as info:
        model.forward_backward((torch.randn(6, 5),), label=y, loss_fn=mse,
                               run_config=RoundPipeRunConfig(num_microbatch=N_MB))
    assert "layer 0 (linear) cannot take an input of shape [2, 5]" in info.value.message
    with pytest.raises(RoundPipeError):
        model.forward_backward((x,), label=torch.randn(6, 3), loss_fn="mse")  # label shape
    with pytest.raises(RoundPipeError):
        model.forward_backward((x,), label=torch.randn(6, 4), loss_fn="cross_entropy")
    with pytest.raises(TypeError):
        model(x, object())
    # nothing was accumulated by the failed calls (no gradient at all: .grad None), nothing
    # changed
    model.synchronize()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model(x), before)


def test_bad_configuration_values():
    with pytest.raises(RoundPipeError):
        RoundPipeRunConfig(num_microbatch=0)
    with pytest.raises(RoundPipeError):
        RoundPipeRunConfig(recompute_grain="everything")
    with pytest.raises(RoundPipeError):
        RoundPipeRunConfig(output_device="meta")
    with pytest.raises(RoundPipeError):
        roundpipe.RoundPipe(MLP_SPEC, devices=("tpu", 1))
    with pytest.raises(RoundPipeError):
        roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 65))
    with pytest.raises(RoundPipeError):
        roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES, stage_plan=[1, 1])  # 6 layers
    with pytest.raises(RoundPipeError):
        roundpipe.RoundPipe(MLP_SPEC, pin_model="glue")
    with pytest.raises(RoundPipeError):
        roundpipe.BuiltinLoss("hinge")


def test_bad_optimizer_settings_are_refused_by_the_engine():
    with pytest.raises(RoundPipeError) as info:
        roundpipe.optim.AdamW(lr=-1.0)
    assert info.value.status == Status.INVALID_ARGUMENT and info.value.message
    with pytest.raises(RoundPipeError):
        roundpipe.optim.AdamW(betas=(1.5, 0.9))
    with pytest.raises(RoundPipeError):
        roundpipe.optim.SGD(momentum=1.0)
    opt = roundpipe.optim.SGD(lr=0.1)
    with pytest.raises(RoundPipeError):
        opt.lr = float("nan")
    assert opt.lr == 0.1
    opt.close()
    opt.close()


def test_optimizer_kind_cannot_change(model):
    x, y = batch()
    model.forward_backward((x,), label=y, loss_fn="mse")
    model.step(roundpipe.optim.AdamW(), is_async=False)
    model.forward_backward((x,), label=y, loss_fn="mse")
    with pytest.raises(RoundPipeError) as info:
        model.step(roundpipe.optim.SGD(), is_async=False)
    assert info.value.status == Status.STATE
    model.step(roundpipe.optim.AdamW(), is_async=False)  # still fine


def test_closed_model_raises_and_close_is_idempotent():
    m = roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES)
    params = list(m.parameters())
    m.close()
    m.close()
    assert m.closed
    with pytest.raises(RoundPipeError) as info:
        m(torch.randn(3, 8))
    assert info.value.status == Status.STATE
    with pytest.raises(RoundPipeError):
        m.step(lambda: None)
    with pytest.raises(RoundPipeError):
        m.synchronize()
    # parameters taken before stay valid tensors
    assert all(torch.isfinite(p).all() for p in params)
    with roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES) as m2:
        assert not m2.closed
    assert m2.closed


class Boom(Exception):
    pass


def test_failing_loss_fn_raises_its_own_exception_and_model_stays_usable(model):
    x, y = batch()
    raised = Boom("from loss_fn")

    def bad(out, label):
        raise raised

    with pytest.raises(Boom) as info:
        model.forward_backward((x,), label=y, loss_fn=bad)
    assert info.value is raised
    with pytest.raises(TypeError, match="got str"):
        model.forward_backward((x,), label=y, loss_fn=lambda o, lab: "not a tensor")
    with pytest.raises(TypeError, match="got float"):  # not iterable: the same message
        model.forward_backward((x,), label=y, loss_fn=lambda o, lab: 0.5)
    # a loss that is not reduced: named with its shape (a microbatch of 2 rows, 4 outputs)
    with pytest.raises(RuntimeError, match=r"scalar loss .* shape \[2, 4\]"):
        model.forward_backward((x,), label=y, loss_fn=lambda o, lab: (o - lab) ** 2)
    with pytest.raises(RuntimeError, match="scalar loss"):
        model.forward_backward((x,), label=y, loss_fn=lambda o, lab: [mse(o, lab), o.sum(0)])
    # failing only on the last microbatch: nothing of the call may be accumulated
    calls = []

    def fails_late(out, label):
        calls.append(1)
        if len(calls) == N_MB:
            raise Boom("late")
        return mse(out, label)

    with pytest.raises(Boom):
        model.forward_backward((x,), label=y, loss_fn=fails_late)
    assert roundpipe._callbacks.registry.__len__() == 0
    # usable: a good call now gives plain torch's loss and gradients, unpolluted
    loss = model.forward_backward((x,), label=y, loss_fn=mse)
    model.synchronize()
    ref = torch_model_like(model, torch_mlp())
    want = microbatch_grads(ref, x, y, N_MB, mse)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))


def test_failing_split_function_raises_its_own_exception(model):
    def bad_split(args, kwargs, n):
        raise Boom("split")

    x, _ = batch()
    with pytest.raises(Boom):
        model(x, roundpipe_run_config=RoundPipeRunConfig(split_input=bad_split))
    with pytest.raises(ValueError):
        model(x, roundpipe_run_config=RoundPipeRunConfig(
            split_input=lambda a, k, n: ([a] * (n - 1), [k] * (n - 1))))
    assert model(x).shape == (6, 4)


def test_failing_sync_step_fn_raises_in_step(model):
    x, y = batch()
    model.forward_backward((x,), label=y, loss_fn=mse)

    def bad():
        raise Boom("sync step")

    with pytest.raises(Boom):
        model.step(bad, is_async=False)
    model.forward_backward((x,), label=y, loss_fn=mse)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    model.synchronize()


def test_failing_async_step_fn_raises_at_the_next_synchronize(model):
    x, y = batch()
    model.forward_backward((x,), label=y, loss_fn=mse)
    raised = Boom("async step")

    def bad():
        raise raised

    model.step(bad)  # returns at once
    with pytest.raises(Boom) as info:
        model.synchronize()
    assert info.value is raised
    model.synchronize()  # reported once
    # usable: an async torch.optim step afterwards
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    before = model.state_dict()
    model.forward_backward((x,), label=y, loss_fn=mse)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_unsupported_inputs_list_what_is_supported():
    # Every nn.Module runs (modules without an engine layer as Python layers:
    # test_python_layers.py); what is not a module, spec or Hugging Face model is refused.
    with pytest.raises(RoundPipeUnsupportedError) as info:
        roundpipe.RoundPipe(12345)
    err = info.value
    assert isinstance(err, RoundPipeError) and isinstance(err, NotImplementedError)
    assert "nn.Module" in err.message and "JSON" in err.message


def test_sequential_preset_demanded_for_a_model_without_one_is_refused():
    # Hugging Face models and their errors: test_hf.py; the recursion: test_python_layers.py.
    with pytest.raises(RoundPipeUnsupportedError) as info:
        roundpipe.wrap_model_to_roundpipe(torch.nn.Linear(2, 2), use_sequential_preset=True)
    assert isinstance(info.value, NotImplementedError) and "Linear" in info.value.message


def test_log_callback_receives_messages():
    got = []
    roundpipe.set_log_callback(lambda level, msg: got.append((level, msg)), roundpipe.LOG_DEBUG)
    try:
        with roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES, name="log-test") as m:
            x, y = batch()
            m.forward_backward((x,), label=y, loss_fn="mse")
    finally:
        roundpipe.set_log_callback(None)
    assert all(isinstance(level, int) and isinstance(msg, str) for level, msg in got)
    with pytest.raises(RoundPipeError):
        roundpipe.set_log_callback(lambda level, msg: None, 7)


def test_model_whose_last_reference_dies_in_its_own_async_step(tmp_path):
    """A step_fn closing over its model may hold the model's last reference; dropping it on the
    optimizer thread must not destroy the model there (it would wait for itself). Run in a
    subprocess with a timeout, so that a deadlock fails the test instead of hanging it."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import gc, time, torch, roundpipe
        from rp_reference import MLP_SPEC

        def train_and_forget():
            model = roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 2))
            opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)

            def step_fn():
                time.sleep(0.05)  # still running when train_and_forget has returned
                torch.nn.utils.clip_grad_norm_(list(model.optim_parameters()), 1.0)
                opt.step()

            model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 4),
                                   loss_fn="mse")
            model.step(step_fn)  # async; returns with the step maybe still queued

        for _ in range(5):
            train_and_forget()
        time.sleep(0.2)
        gc.collect()
        with roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 2)) as m:  # a safe point
            m(torch.randn(3, 8))
        print("OK")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(roundpipe.__path__[0])), here]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
