"""In-call steps (RoundPipe.set_step_in_call, rp_model_set_step_in_call) through the binding.

With host_memory="saving", set_step_in_call(optimizer) makes every forward_backward also the
optimizer step: the header promises the weights of forward_backward followed by a synchronous
step, bit for bit, so (a) compares with explicit steps by equality. (b) compares with
torch.optim.AdamW on a plain torch copy of the module, with the bounds of
tests/c/test_memory_saving.c (adamw_follows_the_reference_within_bf16_moments): the first step
uses the fp32 moments it has just computed (fp32 roundoff: 1e-5); later steps read moments
stored in bf16 (stochastic rounding, below 2^-7 relative), so m_hat / sqrt(v_hat) is off by at
most about 1.2% and each step moves a weight by at most lr * 1.012: after 3 steps at lr 1e-2,
|w - w_ref| <= 3.6e-4 plus the small gradient differences that causes; the bound is 1e-3.
(c) checks the refusals and the switch back to explicit steps.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from rp_reference import microbatch_grads  # noqa: E402

DEVICES = ("cpu", 2)
N_MB = 3  # the default: number of devices + 1
BATCH = 24
LR = 1e-2


def mlp():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4))


def data(call):
    g = torch.Generator().manual_seed(100 + call)
    x = torch.randn(BATCH, 8, generator=g)
    teacher = torch.randn(8, 4, generator=g) / 3
    return x, torch.tanh(x @ teacher)


def saving_model(module=None):
    return roundpipe.RoundPipe(module if module is not None else mlp(), devices=DEVICES,
                               seed=1, host_memory="saving")


def loss_fn():
    # each microbatch's mean, scaled by 1 / N_MB: the sum over microbatches is the batch mean
    return roundpipe.BuiltinLoss("mse", scale=1 / N_MB)


def call(model, i):
    x, y = data(i)
    return float(model.forward_backward((x,), label=y, loss_fn=loss_fn()))


def assert_same_weights(got, want):
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_in_call_steps_equal_explicit_synchronous_steps_bit_for_bit():
    calls = 4
    with saving_model() as inside, saving_model() as explicit:
        initial = inside.state_dict()
        assert_same_weights(explicit.state_dict(), initial)
        opt = roundpipe.optim.AdamW(lr=LR)
        assert inside.step_in_call is False
        inside.set_step_in_call(opt)
        assert inside.step_in_call is True
        assert explicit.step_in_call is False

        got = [call(inside, i) for i in range(calls)]
        want = []
        for i in range(calls):
            want.append(call(explicit, i))
            explicit.step(opt, is_async=False)
        trained = inside.state_dict()

        # not a no-op: every call stepped, each on the previous call's weights
        assert inside.step_count == explicit.step_count == calls
        assert len(set(got)) == calls, got
        for name in initial:
            assert not torch.equal(trained[name], initial[name]), name
        assert got == want
        assert_same_weights(trained, explicit.state_dict())
        assert inside.step_in_call is True  # synchronize() does not switch it off


def test_in_call_adamw_follows_torch_adamw_within_bf16_moments():
    module = mlp()
    ref = copy.deepcopy(module)
    with saving_model(module) as model:
        start = model.copy_to_module(copy.deepcopy(ref)).state_dict()
        for name, value in ref.state_dict().items():
            assert torch.equal(start[name], value), name  # the engine starts from the module
        model.set_step_in_call(roundpipe.optim.AdamW(lr=LR))
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)  # the same defaults
        for i in range(3):
            got = call(model, i)
            ref.zero_grad()
            x, y = data(i)
            want = microbatch_grads(ref, x, y, N_MB,
                                    lambda o, t: torch.nn.functional.mse_loss(o, t) / N_MB)
            opt_ref.step()
            # losses before the first step share the weights; later ones see the differences
            # bounded below (1e-3 absolute on O(0.3) weights)
            assert abs(got - want) <= (1e-5 if i < 2 else 1e-2) * abs(want), (i, got, want)

            weights = model.copy_to_module(copy.deepcopy(ref)).state_dict()
            reference = ref.state_dict()
            worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
            if i == 0:  # fp32 roundoff of a few operations
                for k in reference:
                    torch.testing.assert_close(weights[k], reference[k], rtol=1e-5, atol=1e-6,
                                               msg=lambda m, k=k: "%s: %s" % (k, m))
            else:
                assert worst <= 1e-3, (i + 1, worst)
        assert model.step_count == 3


def test_explicit_steps_are_refused_while_on_and_come_back_with_none():
    opt = roundpipe.optim.AdamW(lr=LR)
    with saving_model() as model:
        # wrong argument types: TypeError before anything changes
        for bad in ("adamw", opt.handle, lambda: None,
                    torch.optim.AdamW(model.optim_parameters(), lr=LR)):
            with pytest.raises(TypeError, match="built-in optimizer"):
                model.set_step_in_call(bad)
            assert model.step_in_call is False

        # gradients accumulated since the last step: refused by the engine, nothing changed
        call(model, 0)
        with pytest.raises(roundpipe.RoundPipeError) as err:
            model.set_step_in_call(opt)
        assert err.value.status == roundpipe.Status.STATE
        assert model.step_in_call is False
        model.zero_grad()

        model.set_step_in_call(opt)
        call(model, 1)
        before, steps = model.state_dict(), model.step_count
        assert steps == 1
        for step_fn in (opt, lambda: None):
            for is_async in (True, False):
                with pytest.raises(roundpipe.RoundPipeError) as err:
                    model.step(step_fn, is_async=is_async)
                assert err.value.status == roundpipe.Status.STATE
        assert model.step_in_call is True
        assert model.step_count == steps
        assert_same_weights(model.state_dict(), before)

        model.set_step_in_call(None)
        assert model.step_in_call is False
        model.set_step_in_call(None)  # already off: no change
        assert model.step_in_call is False
        call(model, 2)
        assert model.state_dict().keys() == before.keys()
        assert_same_weights(model.state_dict(), before)  # no in-call step any more
        model.step(opt, is_async=False)
        assert model.step_count == steps + 1
        after = model.state_dict()
        for name in before:
            assert not torch.equal(after[name], before[name]), name


def test_standard_mode_refuses_in_call_steps():
    with roundpipe.RoundPipe(mlp(), devices=DEVICES, seed=1) as model:
        assert model.host_memory == "standard"
        with pytest.raises(roundpipe.RoundPipeError) as err:
            model.set_step_in_call(roundpipe.optim.AdamW(lr=LR))
        assert err.value.status == roundpipe.Status.STATE
        assert "RP_HOST_MEMORY_SAVING" in err.value.message
        assert model.step_in_call is False
        call(model, 0)
        model.step(roundpipe.optim.AdamW(lr=LR), is_async=False)  # explicit steps still work
        assert model.step_count == 1
