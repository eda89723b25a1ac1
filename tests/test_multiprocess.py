"""Two processes (2 virtual CPU devices each) on localhost: one overflows, both skip.

The processes join through ``jax.distributed.initialize`` (coordinator on a
127.0.0.1 port that the test holds until the coordinator binds it, gloo CPU
collectives), train FSDP-style under ``shard_map`` with
``dynamic_scale(axis_name="d")``, and process 1 poisons its own gradient
blocks at step 2. Then the two processes of ``examples/multiprocess.py`` run
the same way. One pair runs at a time (two cores); each pair is bounded by a
wide timeout and killed if it outlives it.
"""

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jmp_scaler

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
import mp_worker  # noqa: E402

STEPS, BAD_STEP, BAD_PROCESS = 4, 2, 1
# Seconds for a pair of processes: about 15 s alone, a minute with two suites on two
# cores; the margin covers a load of 10 without turning a hang into a long wait.
TIMEOUT = 900


def _held_port():
  """A socket holding a free 127.0.0.1 port (``SO_REUSEPORT``) until it is closed.

  Closing a probe socket and handing its port over leaves a window in which
  another process can take the port. The coordinator's gRPC server binds with
  ``SO_REUSEPORT``, so it can share the held port; every other bind of it,
  and the kernel's choice of a free port for anyone else, is refused while
  the test holds it. The socket never listens, so no connection lands on it.
  """
  if not hasattr(socket, "SO_REUSEPORT"):
    pytest.skip("no SO_REUSEPORT here: a port cannot be held for the coordinator")
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  s.bind(("127.0.0.1", 0))
  return s


def _env():
  # LLVM optimisation off: the programs are tiny and compile time dominates.
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
              XLA_FLAGS="--xla_backend_optimization_level=0")


def _start(commands):
  """Own process groups, so that a timeout kills whatever a process started too."""
  return {name: subprocess.Popen(cmd, cwd=TESTS, env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
          for name, cmd in commands.items()}


def _kill(procs):
  for p in procs.values():
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _finished(procs):
  """Each process's stdout, waited for (one deadline for the pair); skips where gloo cannot
  listen; a failure shows every process's stderr, since one's error is often the other's."""
  outs, errs = {}, {}
  for name, p in procs.items():
    try:
      outs[name], errs[name] = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
      _kill(procs)
      pytest.fail(f"{name} still running after {TIMEOUT} s; killed the pair")
  if any(p.returncode == mp_worker.EXIT_SKIP for p in procs.values()):
    pytest.skip("gloo cannot listen on this host's address: " + " ".join(errs.values())[-300:])
  report = "\n".join(f"--- {n} (rc={p.returncode}):\n{errs[n][-3000:]}" for n, p in procs.items())
  assert all(p.returncode == 0 for p in procs.values()), report
  return outs


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("mp")
  with _held_port() as held:
    port = held.getsockname()[1]
    procs = _start({
        f"p{i}": [sys.executable, str(TESTS / "mp_worker.py"), "--process-id", str(i),
                  "--port", str(port), "--steps", str(STEPS), "--bad-step", str(BAD_STEP),
                  "--bad-process", str(BAD_PROCESS), "--out", str(tmp / f"p{i}.json")]
        for i in range(2)
    })
    try:
      yield tmp, procs
    finally:
      _kill(procs)


@pytest.fixture(scope="module", autouse=True)
def _start_workers_first(request):
  """The workers start with the module's first test (the in-process reference runs meanwhile),
  unless no selected test needs them (``-m "not slow"``)."""
  if any(item.module is request.module and "workers" in item.fixturenames
         for item in request.session.items):
    request.getfixturevalue("workers")


@pytest.fixture(scope="module")
def results(workers):
  tmp, procs = workers
  _finished(procs)
  return [json.loads((tmp / f"p{i}.json").read_text()) for i in range(2)]


@functools.cache
def _single_process():
  """The same training on one device, the global batch; the whole step poisoned at BAD."""
  tx = optax.chain(jmp_scaler.dynamic_scale(mp_worker.SCALE), optax.adam(mp_worker.LR))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=mp_worker.init_params(), tx=tx)

  @jax.jit
  def step(state, x, y, poison):
    s = state.loss_scale
    g = jax.grad(lambda p: mp_worker.loss_fn(p, x, y) * s)(state.params)
    return state.apply_gradients(grads=jax.tree.map(lambda a: a * poison, g))

  scales = []
  for i, (x, y) in enumerate(mp_worker.batches(STEPS)):
    state = step(state, x, y, np.float32(np.inf if i == BAD_STEP else 1.0))
    scales.append(float(state.loss_scale))
  return state, scales


def test_single_process_reference_skips_the_bad_step():
  """Runs first, while the processes work: the run they must match."""
  ref, scales = _single_process()
  assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9] and int(ref.step) == STEPS - 1


@pytest.mark.slow
def test_two_processes_form_one_mesh(results):
  assert [r["process_id"] for r in results] == [0, 1]
  assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in results)


@pytest.mark.slow
def test_both_processes_skip_the_step_one_of_them_overflowed(results):
  expected = [i == BAD_STEP for i in range(STEPS)]
  for r in results:
    assert r["skipped"] == expected
    assert r["step"] == STEPS - 1  # applied updates only
    assert all(r["in_sync"])


def _params(result):
  return {k: np.asarray(v, np.float32) for k, v in result["params"].items()}


@pytest.mark.slow
def test_equal_scales_and_bit_identical_params_across_processes(results):
  a, b = results
  assert a["scales"] == b["scales"]
  for k, v in _params(a).items():
    np.testing.assert_array_equal(v.view(np.uint32), _params(b)[k].view(np.uint32))


@pytest.mark.slow
def test_matches_a_single_process_run(results):
  ref, scales = _single_process()
  assert results[0]["scales"] == scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9]
  got = _params(results[0])
  assert got.keys() == ref.params.keys()
  for k, v in got.items():
    assert v.shape == ref.params[k].shape
    np.testing.assert_allclose(v, ref.params[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_example_runs():
  """The example's processes, started as its launcher would; last, after the workers' pair."""
  with _held_port() as held:
    coordinator = f"127.0.0.1:{held.getsockname()[1]}"
    procs = _start({
        f"e{i}": [sys.executable, str(ROOT / "examples" / "multiprocess.py"), "--num-processes",
                  "2", "--steps", "3", "--bad-step", "1", "--process-id", str(i),
                  "--coordinator", coordinator]
        for i in range(2)
    })
    try:
      outs = _finished(procs)
    finally:
      _kill(procs)
  out = outs["e0"] + outs["e1"]
  finals = [line for line in out.splitlines() if "final" in line]
  assert len(finals) == 2, out
  assert finals[0].split("final", 1)[1] == finals[1].split("final", 1)[1]  # same on both
  assert len(re.findall(r"step   1 loss \S+ scale 2048 skipped=True", out)) == 2, out
