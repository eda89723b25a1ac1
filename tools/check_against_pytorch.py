"""Checks the reference model in tests/_reference.py against the real torch.amp.GradScaler.

Not part of the test suite (it needs PyTorch): `pip install torch numpy` in any environment, then
`python tools/check_against_pytorch.py`. It plays 300 random overflow patterns through
GradScaler on the CPU and through the reference model, and reports every step where they differ.
The only differences expected are where PyTorch's scale falls below the smallest normal float32
(it goes subnormal, then to 0), which jmp_scaler's default min_scale prevents.
"""

import pathlib
import random
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from tests._reference import F32, reference_history  # noqa: E402

warnings.simplefilter("ignore")
random.seed(0)
n_ok = below_normal = 0
for trial in range(300):
  interval = random.randint(1, 6)
  init = 2.0 ** random.randint(-10, 125)
  growth = random.choice([2.0, 1.5, 3.0, 1.25, 4.0, 1.1])
  backoff = random.choice([0.5, 0.25, 0.75, 0.125, 0.3])
  rate = random.choice([0.1, 0.5, 0.9])
  pattern = [random.random() < rate for _ in range(random.randint(1, 200))]
  sc = torch.amp.GradScaler(
      "cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
      growth_interval=interval,
  )
  p = torch.nn.Parameter(torch.ones(2))
  opt = torch.optim.SGD([p], lr=0.0)
  got = []
  for bad in pattern:
    opt.zero_grad()
    loss = (p.sum() * (float("inf") if bad else 1.0))
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    got.append((float(sc.get_scale()), int(sc._growth_tracker.item())))
  exp = reference_history(pattern, init, growth, backoff, interval)
  if got != exp:
    i = next(k for k in range(len(got)) if got[k] != exp[k])
    below_normal += got[i][0] < F32.tiny
    print(f"differ: trial {trial} step {i}: torch {got[i]} reference {exp[i]}")
    continue
  n_ok += 1
print(f"{n_ok} of 300 patterns agree at every step; {below_normal} differ only once "
      "PyTorch's scale is below the smallest normal float32")
