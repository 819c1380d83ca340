"""Upstream's page "Custom Execution Plans" (UserGuide_AdvancedUsage_execute_plan, and the
Execution Plan section of API_run_config): ModelExecutePlan, RoundPipeRunConfig(execute_plan=),
ModelExecutePlan.auto, the validation rules, on CPU worker devices against plain PyTorch.

The engine holds a stage plan and a backward stage plan per model: symmetric plans and
upstream's asymmetric ones (backward stages that start inside forward stages) run, model-level
or per call (the engine switches its plans for the call), and train as plain PyTorch does."""

import copy

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import (ModelExecutePlan, RoundPipe, RoundPipeError,  # noqa: E402
                       RoundPipeRunConfig, RoundPipeUnsupportedError, Status)

DEVICES = ("cpu", 2)
RTOL = 1e-5


def four_layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def loss_fn(out, label):
    return ((out - label) ** 2).sum()


def reference_grads(net, x, y):
    ref = copy.deepcopy(net)
    loss = loss_fn(ref(x), y)
    loss.backward()
    return float(loss), [p.grad.clone() for p in ref.parameters()]


def check_training(model, net, run_config=None):
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    want_loss, want_grads = reference_grads(net, x, y)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                  run_config=run_config)
    assert float(loss) == pytest.approx(want_loss, rel=RTOL)
    model.synchronize()
    for p, g in zip(net.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=1e-6)
    model.zero_grad()


def symmetric_fused_plan():
    """fwd_plan covers layers 0..2, the tail (layer 3) is the first backward stage, backward
    stages are the forward ones reversed: the engine's stage plan [2, 1, 1]."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 3)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(0, 2)]
    return plan


def test_plan_has_the_documented_attributes():
    plan = ModelExecutePlan()
    assert plan.fwd_plan == [] and plan.bwd_plan == []
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    assert "range(0, 2)" in repr(plan)


def test_model_level_plan_builds_the_stages_and_trains_as_pytorch():
    net = four_layers()
    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            execute_plan=symmetric_fused_plan())) as model:
        assert model.stage_plan() == [2, 1, 1]
        check_training(model, net)
        # the same plan per call is the plan in force: accepted
        check_training(model, net, RoundPipeRunConfig(execute_plan=symmetric_fused_plan()))


def test_forward_form_plan_model_level_and_per_call():
    net = four_layers()
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 1), range(1, 4)]
    plan.bwd_plan = [range(1, 4), range(0, 1)]
    with RoundPipe(net, devices=DEVICES,
                   model_run_config=RoundPipeRunConfig(execute_plan=plan)) as model:
        assert model.stage_plan() == [1, 3]
        x = torch.randn(6, 8)
        with torch.no_grad():
            want = net(x)
            got = model(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan))
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
        # the inference form of the same stages: no backward plan
        infer = ModelExecutePlan.auto("infer", model)
        assert infer.fwd_plan == [range(0, 1), range(1, 4)] and infer.bwd_plan == []
        with torch.no_grad():
            got = model(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=infer))
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)


def test_auto_returns_the_engines_plan_and_it_runs():
    net = four_layers()
    with RoundPipe(net, devices=DEVICES, stage_plan=[1, 2, 1]) as model:
        plan = ModelExecutePlan.auto("fused", model)
        assert isinstance(plan, ModelExecutePlan)
        assert plan.fwd_plan == [range(0, 1), range(1, 3)]
        assert plan.bwd_plan == [range(3, 4), range(1, 3), range(0, 1)]
        check_training(model, net, RoundPipeRunConfig(execute_plan=plan))
        train = ModelExecutePlan.auto("train", model)
        assert train.fwd_plan == [range(0, 1), range(1, 3), range(3, 4)]
        assert train.bwd_plan == list(reversed(train.fwd_plan))


def test_auto_on_the_engines_automatic_plan():
    net = four_layers()
    with RoundPipe(net, devices=DEVICES) as model:
        counts = model.stage_plan()
        plan = ModelExecutePlan.auto("fused", model, upper_threshold=1.5)
        assert [len(r) for r in plan.fwd_plan] + [len(plan.bwd_plan[0])] == counts
        check_training(model, net, RoundPipeRunConfig(execute_plan=plan))


def stage_bytes(net, plan):
    """Each stage's weights and gradients in fp32 (the model dtype), from torch's parameters."""
    counts = [len(r) for r in plan.fwd_plan] + [len(plan.bwd_plan[0])]
    layer = [2 * 4 * sum(p.numel() for p in m.parameters()) for m in net]
    out, at = [], 0
    for n in counts:
        out.append(sum(layer[at:at + n]))
        at += n
    assert at == len(net)
    return out


def test_auto_plans_stages_under_model_memory_limit_and_min_stages():
    """upstream's resolve_oom page: a lower model_memory_limit forces smaller stages (each
    stage's weights and gradients within half of it); min_stages raises the stage count. The
    engine's planner makes the plan (rp_model_plan_stages); the model's own plan stays; the plan
    trains as PyTorch."""
    net = four_layers()  # fp32 weights + gradients per layer: 1152, 0, 2176, 544 bytes
    with RoundPipe(net, devices=DEVICES, stage_plan=[4]) as model:
        per_stage = 2200  # bytes: layers 2 and 3 cannot share a stage, 0 and 1 can
        plan = ModelExecutePlan.auto("fused", model, model_memory_limit=2 * per_stage / 2 ** 30)
        sizes = stage_bytes(net, plan)
        assert len(sizes) >= 3 and max(sizes) <= per_stage
        assert model.stage_plan() == [4]  # planning changed nothing
        check_training(model, net, RoundPipeRunConfig(execute_plan=plan))
        four = ModelExecutePlan.auto("train", model, min_stages=4)
        assert four.fwd_plan == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
        assert ModelExecutePlan.auto("fused", model, min_stages=9).fwd_plan == \
            four.fwd_plan[:3]  # one layer per stage at most
        with pytest.raises(RoundPipeError, match="layer 2 alone"):
            ModelExecutePlan.auto("fused", model, model_memory_limit=2 * 2000 / 2 ** 30)


def test_auto_with_several_models_gives_one_plan_each_and_they_chain():
    torch.manual_seed(1)
    enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    dec = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with RoundPipe(enc, devices=DEVICES) as model1, RoundPipe(dec, devices=DEVICES) as model2:
        plan1, plan2 = ModelExecutePlan.auto("fused", model1, model2)
        assert isinstance(plan1, ModelExecutePlan) and isinstance(plan2, ModelExecutePlan)
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        # upstream's example: model1 forward without merging, its output into model2
        with torch.no_grad():
            out1 = model1.forward(x, roundpipe_run_config=RoundPipeRunConfig(
                execute_plan=ModelExecutePlan.auto("infer", model1), merge_output=False))
        assert isinstance(out1, roundpipe.RoundPipePackedData)
        loss = model2.forward_backward(input_args=(out1,), label=y, loss_fn=loss_fn,
                                       run_config=RoundPipeRunConfig(execute_plan=plan2))
        with torch.no_grad():
            want = loss_fn(dec(enc(x)), y)
        assert float(loss) == pytest.approx(float(want), rel=RTOL)


def test_a_per_call_plan_runs_that_call_on_its_stages_then_the_model_plan_returns():
    """A per-call plan other than the model's switches the engine's stages for that call
    (rp_model_set_stage_plan) and trains as PyTorch; the next call without one runs on the
    model's own plan again; RoundPipe.set_stage_plan changes the model's own plan."""
    net = four_layers()
    with RoundPipe(net, devices=DEVICES, stage_plan=[2, 1, 1]) as model:
        other = ModelExecutePlan()
        other.fwd_plan = [range(0, 1), range(1, 3)]
        other.bwd_plan = [range(3, 4), range(1, 3), range(0, 1)]
        check_training(model, net, RoundPipeRunConfig(execute_plan=other))
        assert model.stage_plan() == [1, 2, 1]
        check_training(model, net)
        assert model.stage_plan() == [2, 1, 1]
        model.set_stage_plan([1, 3])
        check_training(model, net)
        assert model.stage_plan() == [1, 3]
        with pytest.raises(RoundPipeError, match="covers"):
            model.set_stage_plan([1, 1])
        assert model.stage_plan() == [1, 3]


def upstream_forward_example():
    """The page's forward() example: 2 forward stages, 4 backward stages."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    return plan


def upstream_fused_example():
    """The page's forward_backward() example: fwd_plan [0, 3), backward one layer per stage."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    return plan


def test_upstreams_fused_asymmetric_example_trains_as_pytorch():
    """Per call, on a model with another plan: the engine runs forward stage [0, 3), the tail
    [3, 4), and backward stages [2], [1], [0] recomputed from activations the forward downloaded
    from inside its stage; gradients as plain PyTorch's. Model-level, the same plan; a training
    call with several microbatches too."""
    net = four_layers()
    with RoundPipe(net, devices=DEVICES, stage_plan=[2, 2]) as model:
        check_training(model, net, RoundPipeRunConfig(execute_plan=upstream_fused_example()))
        # the next call without a plan runs on the model's own again
        check_training(model, net)
        assert model.stage_plan() == [2, 2] and model.backward_stage_plan() == [2, 2]
    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            execute_plan=upstream_fused_example(), num_microbatch=3)) as model:
        assert model.stage_plan() == [3, 1]
        assert model.backward_stage_plan() == [1, 1, 1, 1]
        check_training(model, net)
        assert ModelExecutePlan.auto("fused", model) == upstream_fused_example()


def test_upstreams_forward_asymmetric_example_trains_through_autograd():
    """forward() in training mode keeps the input of each of the 4 backward stages (three of
    them from inside the 2 forward stages); loss.backward() back-propagates through them."""
    net = four_layers()
    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            execute_plan=upstream_forward_example())) as model:
        assert model.stage_plan() == [2, 2]
        assert model.backward_stage_plan() == [1, 1, 1, 1]
        assert ModelExecutePlan.auto("train", model) == upstream_forward_example()
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        want_loss, want_grads = reference_grads(net, x, y)
        loss = loss_fn(model(x), y)
        loss.backward()
        assert float(loss) == pytest.approx(want_loss, rel=RTOL)
        model.synchronize()
        for p, g in zip(net.parameters(), want_grads):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=1e-6)
        # The train-form plan ends with stage [2, 4) forward but [3, 4) backward: a fused call
        # has no single tail, and the engine says so (nothing changed).
        with pytest.raises(RoundPipeError, match="same stage") as err:
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        assert err.value.status == Status.INVALID_ARGUMENT


def test_backward_stage_plan_methods():
    with RoundPipe(four_layers(), devices=DEVICES) as model:
        with pytest.raises(RoundPipeError, match="explicit forward") as err:
            model.set_backward_stage_plan([1, 1, 1, 1])
        assert err.value.status == Status.STATE
        model.set_stage_plan([3, 1])
        model.set_backward_stage_plan([1, 1, 1, 1])
        assert model.backward_stage_plan() == [1, 1, 1, 1]
        with pytest.raises(RoundPipeError, match="covers"):
            model.set_backward_stage_plan([1, 1])
        assert model.backward_stage_plan() == [1, 1, 1, 1]
        model.set_backward_stage_plan(None)
        assert model.backward_stage_plan() == [3, 1]
        # after a call on a per-call plan, a backward plan goes with the model's own forward plan
        model.forward_backward(input_args=(torch.randn(6, 8),), label=torch.randn(6, 4),
                               loss_fn=loss_fn, run_config=RoundPipeRunConfig(
                                   execute_plan=ModelExecutePlan.from_stage_plan([2, 2])))
        assert model.stage_plan() == [2, 2]
        model.set_backward_stage_plan([1, 1, 1, 1])
        assert model.stage_plan() == [3, 1] and model.backward_stage_plan() == [1, 1, 1, 1]


def _plan(fwd, bwd):
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = fwd, bwd
    return plan


@pytest.mark.parametrize("plan, run_type, needle", [
    (_plan([range(0, 2), range(1, 4)], []), "infer", "fwd_plan\\[1\\]"),          # overlap
    (_plan([range(0, 1), range(2, 4)], []), "infer", "fwd_plan\\[1\\]"),          # gap
    (_plan([range(2, 4), range(0, 2)], []), "infer", "ascending"),                # order
    (_plan([range(0, 2)], []), "infer", "must cover every layer"),               # short
    (_plan([range(0, 4)], [range(0, 2), range(2, 4)]), "train", "descending"),   # bwd order
    (_plan([range(0, 4)], [range(3, 4), range(1, 3)]), "train", "down to 0"),    # bwd short
    (_plan([range(0, 2)], [range(3, 4), range(2, 3), range(0, 2)]), "fused",
     "must start where fwd_plan stops"),                                          # fused rule
    (_plan([range(0, 4)], [range(2, 4), range(0, 2)]), "fused", "fwd_plan covers every"),
    (_plan([range(0, 2)], []), "fused", "bwd_plan is empty"),
    (_plan([range(0, 5)], []), "infer", "model has 4 layers"),
    (_plan([range(0, 2, 2)], []), "infer", "fwd_plan\\[0\\]"),                   # step
    (_plan("0-4", []), "infer", "list of range"),
])
def test_plans_breaking_upstreams_rules_raise_naming_execute_plan(plan, run_type, needle):
    with pytest.raises(RoundPipeError, match=needle) as err:
        plan.stage_plan(4, run_type)
    assert err.value.status == Status.INVALID_ARGUMENT
    assert "execute_plan" in str(err.value)
    assert not isinstance(err.value, RoundPipeUnsupportedError)


def test_bad_plans_at_call_and_model_level():
    bad = _plan([range(0, 2), range(1, 4)], [])
    with RoundPipe(four_layers(), devices=DEVICES) as model:
        with pytest.raises(RoundPipeError, match="execute_plan"):
            model(torch.randn(6, 8), roundpipe_run_config=RoundPipeRunConfig(execute_plan=bad))
    with pytest.raises(RoundPipeError, match="execute_plan"):
        RoundPipe(four_layers(), devices=DEVICES,
                  model_run_config=RoundPipeRunConfig(execute_plan=bad))
    with pytest.raises(RoundPipeError, match="execute_plan must be a roundpipe.ModelExecutePlan"):
        RoundPipeRunConfig(execute_plan=[range(0, 4)])
    with pytest.raises(RoundPipeError, match="stage_plan .* execute_plan"):
        RoundPipe(four_layers(), devices=DEVICES, stage_plan=[1, 3],
                  model_run_config=RoundPipeRunConfig(execute_plan=symmetric_fused_plan()))


def test_auto_bad_arguments_name_them():
    with RoundPipe(four_layers(), devices=DEVICES) as model:
        with pytest.raises(RoundPipeError, match="run_type"):
            ModelExecutePlan.auto("both", model)
        with pytest.raises(RoundPipeError, match="at least one"):
            ModelExecutePlan.auto("fused")
        with pytest.raises(RoundPipeError, match="models\\[1\\]"):
            ModelExecutePlan.auto("fused", model, four_layers())
        with pytest.raises(RoundPipeError, match="min_stages"):
            ModelExecutePlan.auto("fused", model, min_stages=0)
        with pytest.raises(RoundPipeError, match="upper_threshold"):
            ModelExecutePlan.auto("fused", model, upper_threshold=0.5)
        with pytest.raises(RoundPipeError, match="model_memory_limit"):
            ModelExecutePlan.auto("fused", model, model_memory_limit=-1)
        assert isinstance(ModelExecutePlan.auto("fused", model, model_memory_limit=8.0),
                          ModelExecutePlan)
        with pytest.raises(RoundPipeError, match="alone needs"):  # less than one layer
            ModelExecutePlan.auto("fused", model, model_memory_limit=1e-9)


def test_from_stage_plan_round_trips():
    for counts in ([4], [1, 1, 1, 1], [2, 1, 1], [1, 3]):
        for run_type in ("infer", "train", "fused"):
            if run_type == "fused" and len(counts) == 1:
                plan = ModelExecutePlan.from_stage_plan(counts, run_type)
                assert plan.fwd_plan == [] and plan.bwd_plan == [range(0, 4)]
            plan = ModelExecutePlan.from_stage_plan(counts, run_type)
            assert plan.stage_plan(4, run_type) == (counts, None)
    # with backward stages of their own
    plan = ModelExecutePlan.from_stage_plan([3, 1], "fused", [1, 1, 1, 1])
    assert plan == upstream_fused_example()
    assert plan.stage_plan(4, "fused") == ([3, 1], [1, 1, 1, 1])
    plan = ModelExecutePlan.from_stage_plan([2, 2], "train", [1, 1, 1, 1])
    assert plan == upstream_forward_example()
    assert plan.stage_plan(4, "train") == ([2, 2], [1, 1, 1, 1])
