"""Two processes (2 virtual CPU devices each) on localhost: one overflows, both skip.

The processes join through ``jax.distributed.initialize`` (coordinator on a
free 127.0.0.1 port, gloo CPU collectives pinned to 127.0.0.1), train
FSDP-style under ``shard_map`` with ``dynamic_scale(axis_name="d")``, and
process 1 poisons its own gradient blocks at step 2. Every subprocess is
bounded by a timeout and killed if it outlives it.
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
TIMEOUT = 150


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  # LLVM optimisation off: the programs are tiny and compile time dominates.
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
              XLA_FLAGS="--xla_backend_optimization_level=0")


@pytest.fixture(scope="module", autouse=True)
def started(tmp_path_factory):
  """The two workers and the example's launcher start together; survivors are killed."""
  tmp = tmp_path_factory.mktemp("mp")
  port = _free_port()
  commands = {
      f"p{i}": [sys.executable, str(TESTS / "mp_worker.py"), "--process-id", str(i),
                "--port", str(port), "--steps", str(STEPS), "--bad-step", str(BAD_STEP),
                "--bad-process", str(BAD_PROCESS), "--out", str(tmp / f"p{i}.json")]
      for i in range(2)
  }
  commands["example"] = [sys.executable, str(ROOT / "examples" / "multiprocess.py"),
                         "--num-processes", "2", "--steps", "3", "--bad-step", "1",
                         "--timeout", str(TIMEOUT - 10)]
  # Own process groups, so that a timeout also kills the example's workers.
  procs = {name: subprocess.Popen(cmd, cwd=TESTS, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
           for name, cmd in commands.items()}
  yield tmp, procs
  for p in procs.values():
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _finished(procs, name):
  """The stdout of a successful run, waited for (bounded); skips where gloo cannot use loopback."""
  out, err = procs[name].communicate(timeout=TIMEOUT)
  if procs[name].returncode == mp_worker.EXIT_SKIP:
    pytest.skip("gloo cannot be pinned to 127.0.0.1 on this machine")
  assert procs[name].returncode == 0, err[-3000:]
  return out


@pytest.fixture(scope="module")
def results(started):
  tmp, procs = started
  for name in ("p0", "p1"):
    _finished(procs, name)
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


def test_two_processes_form_one_mesh(results):
  assert [r["process_id"] for r in results] == [0, 1]
  assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in results)


def test_both_processes_skip_the_step_one_of_them_overflowed(results):
  expected = [i == BAD_STEP for i in range(STEPS)]
  for r in results:
    assert r["skipped"] == expected
    assert r["step"] == STEPS - 1  # applied updates only
    assert all(r["in_sync"])


def _params(result):
  return {k: np.asarray(v, np.float32) for k, v in result["params"].items()}


def test_equal_scales_and_bit_identical_params_across_processes(results):
  a, b = results
  assert a["scales"] == b["scales"]
  for k, v in _params(a).items():
    np.testing.assert_array_equal(v.view(np.uint32), _params(b)[k].view(np.uint32))


def test_matches_a_single_process_run(results):
  ref, scales = _single_process()
  assert results[0]["scales"] == scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9]
  got = _params(results[0])
  assert got.keys() == ref.params.keys()
  for k, v in got.items():
    assert v.shape == ref.params[k].shape
    np.testing.assert_allclose(v, ref.params[k], rtol=1e-5, atol=1e-6)


def test_example_runs(started):
  out = _finished(started[1], "example")
  finals = [line for line in out.splitlines() if "final" in line]
  assert len(finals) == 2, out
  assert finals[0].split("final", 1)[1] == finals[1].split("final", 1)[1]  # same on both
  assert len(re.findall(r"step   1 loss \S+ scale 2048 skipped=True", out)) == 2, out
