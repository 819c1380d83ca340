"""Data parallelism over two processes gives what one process gives on the whole batch.

torchrun launches dp_worker.py on 2 ranks (2 CPU worker devices each); each rank trains on its
half of every 8-row batch in 2 microbatches (10 synchronous, then 10 asynchronous steps, global
loss on). In this process the same model trains on the whole batch in 4 microbatches, so that
every microbatch holds the same rows: the mean of the ranks' gradients is the single process's
gradient and the mean of their losses its loss. Losses and final weights must agree to 1e-5
relative (fp32; absolute floor 1e-6 for entries near zero), on every rank.

Also: the settings are checked (DataParallel, the engine's setters), a model without data
parallelism is rank 0 of 1, only rank 0 saves, and a rank that dies makes the other's calls fail
(Status.IO, then Status.STATE).

Each torchrun launch takes some seconds on 2 cores (two processes importing torch).
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import DataParallel, RoundPipeError, Status  # noqa: E402

import dp_worker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BINDING = os.path.normpath(os.path.join(HERE, "..", "..", "bindings", "python"))
RTOL = 1e-5
ATOL = 1e-6
TIMEOUT_S = 240

needs_dp = pytest.mark.skipif(not roundpipe.data_parallel_available(),
                              reason="this libroundpipe was built without c10d's Gloo support "
                                     "(rp_data_parallel_available() is 0)")


def run_ranks(mode, out):
    """Run dp_worker.py MODE OUT on 2 ranks under torchrun; returns each rank's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [HERE] if os.environ.get("ROUNDPIPE_TEST_INSTALLED") == "1" else [BINDING, HERE]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", os.path.join(HERE, "dp_worker.py"), mode, str(out)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=TIMEOUT_S)
    log = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, "torchrun %s failed (%d):\n%s" % (mode, proc.returncode, log)
    results = []
    for rank in range(2):
        path = "%s.rank%d" % (out, rank)
        if os.path.exists(path):
            results.append(torch.load(path, weights_only=False))
        else:
            results.append(None)
    return results, log


def single_process(kind):
    """The same training on the whole batch in one process, 4 microbatches."""
    torch.set_num_threads(1)
    with dp_worker.build(kind, 4, seed=0) as model:
        return dp_worker.train(model, kind, slice(0, dp_worker.BATCH), 4)


def assert_same_training(results, kind):
    want_losses, want_state = single_process(kind)
    for rank, got in enumerate(results):
        assert got is not None, "rank %d wrote nothing" % rank
        assert (got["rank"], got["world_size"]) == (rank, 2)
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(want_losses, dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL,
                                   msg=lambda m, rank=rank: "rank %d losses: %s" % (rank, m))
        assert list(got["state"]) == list(want_state)
        for name, value in want_state.items():
            torch.testing.assert_close(
                got["state"][name], value, rtol=RTOL, atol=ATOL,
                msg=lambda m, rank=rank, name=name: "rank %d %s: %s" % (rank, name, m))


@needs_dp
def test_two_ranks_from_torchrun_env_match_one_process(tmp_path):
    """JSON spec (rank 1 seeded differently: creation gives it rank 0's weights), built-in
    AdamW and MSE, DataParallel() from torchrun's environment."""
    out = tmp_path / "env"
    results, _ = run_ranks("env", out)
    assert_same_training(results, "spec")
    assert os.path.exists("%s.rank0.safetensors" % out)
    assert not os.path.exists("%s.rank1.safetensors" % out), "only rank 0 saves"


@needs_dp
def test_two_ranks_from_process_group_match_one_process(tmp_path):
    """nn.Sequential, torch.optim.AdamW in a step_fn, a Python loss_fn, the rendezvous made by
    DataParallel.from_process_group over an initialised gloo process group."""
    results, _ = run_ranks("pg", tmp_path / "pg")
    assert_same_training(results, "module")


@needs_dp
def test_a_dead_rank_fails_the_other_then_the_model_refuses_work(tmp_path):
    results, log = run_ranks("die", tmp_path / "die")
    assert results[1] is None  # rank 1 died before writing
    assert results[0] is not None, log
    errors = results[0]["errors"]
    assert [status for status, _ in errors] == [int(Status.IO), int(Status.STATE)], errors


def test_a_model_without_data_parallelism_is_rank_0_of_1():
    with roundpipe.RoundPipe(dp_worker.SPEC, devices=("cpu", 1)) as model:
        assert (model.rank, model.world_size) == (0, 1)
    with roundpipe.RoundPipe(dp_worker.SPEC, devices=("cpu", 1),
                             data_parallel=DataParallel(world_size=0)) as model:
        assert (model.rank, model.world_size) == (0, 1)


@needs_dp
def test_a_world_of_one_is_rank_0_of_1():
    dp = DataParallel(rank=0, world_size=1, rendezvous="tcp://127.0.0.1:%d"
                      % roundpipe.distributed._free_port("127.0.0.1"), timeout=30)
    with roundpipe.RoundPipe(dp_worker.SPEC, devices=("cpu", 1), data_parallel=dp) as model:
        assert (model.rank, model.world_size) == (0, 1)


@pytest.mark.parametrize("kwargs", [dict(world_size=-2), dict(rank=2, world_size=2),
                                    dict(rank=-3), dict(timeout=0), dict(timeout=-1.0)])
def test_invalid_settings_are_invalid_arguments(kwargs):
    with pytest.raises(RoundPipeError) as e:
        DataParallel(**kwargs)
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("kwargs", [dict(rank="0"), dict(world_size=2.0),
                                    dict(rendezvous=5), dict(global_loss=1)])
def test_settings_of_the_wrong_type_are_type_errors(kwargs):
    with pytest.raises(TypeError):
        DataParallel(**kwargs)


def test_data_parallel_argument_must_be_a_data_parallel():
    with pytest.raises(TypeError):
        roundpipe.RoundPipe(dp_worker.SPEC, devices=("cpu", 1), data_parallel="env://")


@needs_dp
def test_a_bad_rendezvous_fails_creation():
    dp = DataParallel(rank=0, world_size=1, rendezvous="udp://127.0.0.1:1", timeout=5)
    with pytest.raises(RoundPipeError) as e:
        roundpipe.RoundPipe(dp_worker.SPEC, devices=("cpu", 1), data_parallel=dp)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_from_process_group_needs_an_initialised_group():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RoundPipeError) as e:
        DataParallel.from_process_group()
    assert e.value.status == Status.STATE


def test_timedelta_timeouts_and_defaults():
    import datetime
    dp = DataParallel(timeout=datetime.timedelta(minutes=2))
    assert dp.timeout == 120.0
    assert dp.engine_values() == (-1, -1, b"env://", 120000, 0)
    assert DataParallel(rendezvous=None).rendezvous == "env://"
    assert DataParallel().engine_values()[3] == 0  # no timeout given: the engine's default


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_wrap_refuses_data_parallel_for_an_auto_roundpipe():
    dp = DataParallel(rank=0, world_size=1, rendezvous="tcp://127.0.0.1:1")
    model = TwoLinears()
    with pytest.raises(roundpipe.RoundPipeUnsupportedError):
        roundpipe.wrap_model_to_roundpipe(model, upper_threshold=0, devices=("cpu", 1),
                                          data_parallel=dp)
    assert isinstance(model.a, torch.nn.Linear)  # nothing was wrapped


@needs_dp
def test_wrap_passes_data_parallel_to_a_whole_model_roundpipe():
    dp = DataParallel(rank=0, world_size=1, rendezvous="tcp://127.0.0.1:%d"
                      % roundpipe.distributed._free_port("127.0.0.1"), timeout=30)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with roundpipe.wrap_model_to_roundpipe(net, devices=("cpu", 1), data_parallel=dp) as model:
        assert (model.rank, model.world_size) == (0, 1)
