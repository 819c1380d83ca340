"""The binding on GPU devices: outputs returned on the GPU, inputs on the GPU, a Python loss_fn
that runs on the GPU, and training that matches plain torch on the same GPU. Skipped without a
CUDA GPU visible to both torch and libroundpipe.

Tolerance: fp32 relative 1e-5 with a 1e-6 absolute floor, as on the CPU. TF32 is switched off
for the plain-torch reference (torch's default for matmul), and the engine computes fp32
weights in fp32; what differs is the order of reductions, a few ulp per step.
"""

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from rp_reference import MLP_SPEC, microbatch_grads, torch_mlp, torch_model_like  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def _gpus():
    if not torch.cuda.is_available():
        return 0
    try:
        return roundpipe.cuda_device_count()
    except roundpipe.RoundPipeError:
        return 0


pytestmark = pytest.mark.skipif(_gpus() == 0, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_gpu_model_with_host_inputs_and_gpu_outputs():
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cuda", 1), seed=3) as model:
        assert model.num_devices == 1
        ref = torch_model_like(model, torch_mlp()).cuda()
        x = torch.randn(8, 8)
        want = ref(x.cuda()).detach()
        out = model(x)  # outputs on the CPU by default
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, want.cpu(), **TOL)
        cfg = roundpipe.RoundPipeRunConfig(output_device=torch.device("cuda:0"))
        out_gpu = model(x, roundpipe_run_config=cfg)
        assert out_gpu.device == torch.device("cuda:0")
        torch.testing.assert_close(out_gpu, want, **TOL)
        _, out_fb = model.forward_backward((x,), label=torch.randn(8, 4), loss_fn="mse",
                                           return_outputs=True, run_config=cfg)
        assert out_fb.device == torch.device("cuda:0")


def test_gpu_inputs_are_accepted():
    """roundpipe.h: inputs are "on the CPU (or on a GPU for GPU models)"."""
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cuda", 1), seed=3) as model:
        ref = torch_model_like(model, torch_mlp()).cuda()
        x = torch.randn(8, 8, device="cuda")
        torch.testing.assert_close(model(x), ref(x).detach().cpu(), **TOL)
        y = torch.randn(8, 4, device="cuda")
        loss = model.forward_backward((x,), label=y, loss_fn="mse")
        assert float(loss) == pytest.approx(
            microbatch_grads(ref, x, y, 2, torch.nn.functional.mse_loss), rel=1e-5)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_gpu_training_with_torch_adamw_matches_plain_torch(is_async):
    n_mb = 2  # one GPU: the default is number of devices + 1
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cuda", 1), seed=4) as model:
        ref = torch_model_like(model, torch_mlp()).cuda()
        compute = torch_mlp().cuda()
        compute.load_state_dict(ref.state_dict())
        opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)

        def step_fn():
            opt.step()
            opt.zero_grad()

        def loss_fn(out, y):
            return torch.nn.functional.mse_loss(out, y)

        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 8, generator=g)  # inputs in host memory
            y = torch.randn(8, 4, generator=g).cuda()  # labels on the GPU: loss_fn runs there
            loss = model.forward_backward((x,), label=y, loss_fn=loss_fn)
            model.step(step_fn, is_async)
            net = compute if is_async else ref
            net.zero_grad()
            want = microbatch_grads(net, x.cuda(), y, n_mb, loss_fn)
            assert float(loss) == pytest.approx(want, rel=1e-5)
            if is_async:  # staleness one: see test_training.reference_training
                before = {k: v.clone() for k, v in ref.state_dict().items()}
                for p, q in zip(ref.parameters(), compute.parameters()):
                    p.grad = q.grad.clone()
                opt_ref.step()
                compute.load_state_dict(before)
            else:
                opt_ref.step()
            opt_ref.zero_grad()
        model.synchronize()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, ref.state_dict()[name].cpu(), **TOL,
                                       msg=lambda m, name=name: "%s: %s" % (name, m))
