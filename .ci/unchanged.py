"""Fails when installing jmp_scaler changed a package of the user's JAX stack.

  python .ci/unchanged.py BEFORE AFTER NAME...   (BEFORE, AFTER: `pip list --format=freeze`)

Prints the versions it compared: the newest job's record of what it tested.
"""

import re
import sys


def versions(path: str) -> dict[str, str]:
  found = {}
  for line in open(path):
    name, _, version = line.strip().partition("==")
    found[re.sub(r"[-_.]+", "-", name).lower()] = version
  return found


def main() -> int:
  before, after = versions(sys.argv[1]), versions(sys.argv[2])
  changed = []
  for name in sys.argv[3:]:
    key = re.sub(r"[-_.]+", "-", name).lower()
    print(f"newest: {name} {before.get(key)}" + ("" if before.get(key) == after.get(key)
                                                 else f" -> {after.get(key)}"))  # fmt: skip
    if before.get(key) != after.get(key):
      changed.append(f"{name} {before.get(key)} -> {after.get(key)}")
  if changed:
    print(f"installing jmp_scaler changed the user's JAX stack: {', '.join(changed)}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
