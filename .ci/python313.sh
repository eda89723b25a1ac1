#!/usr/bin/env bash
# Prints the path of a CPython 3.13 interpreter, building it once from Debian trixie's source
# package (the machine's own Debian mirror) into a cache directory outside the clone, so a
# second CI run on the same machine reuses it. Everything it prints besides the path goes to
# stderr. The cache directory: $JMP_SCALER_CI_CACHE, else ~/.cache/jmp_scaler-ci. A working
# python3.13 already on the machine is used as it is (JMP_SCALER_CI_BUILD_PYTHON=1 builds anyway).
set -euo pipefail
cache="${JMP_SCALER_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jmp_scaler-ci}"
prefix="$cache/python3.13"
python="$prefix/bin/python3.13"
if [ -x "$python" ] && "$python" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes' 2>/dev/null; then
  echo "$python"; exit 0
fi
# A working CPython 3.13 already on the machine (on PATH, or pyenv's), unless told to build.
if [ -z "${JMP_SCALER_CI_BUILD_PYTHON:-}" ]; then
  for candidate in python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13; do
    found="$(command -v "$candidate" 2>/dev/null || true)"
    if [ -n "$found" ] && "$found" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes, venv' 2>/dev/null; then
      echo "$found"; exit 0
    fi
  done
fi
{
  echo "building CPython 3.13 into $prefix (once per machine; about 3 minutes on 2 cores)"
  mkdir -p "$cache"
  work="$(mktemp -d "$cache/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  # The mirror the machine already uses, with trixie's sources; the system's own lists untouched.
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  mkdir -p "$work/lists/partial"
  echo "deb-src $mirror trixie main" > "$work/sources.list"
  apt_opts=(-o Dir::Etc::sourcelist="$work/sources.list" -o Dir::Etc::sourceparts=-
            -o Dir::State::Lists="$work/lists" -o APT::Get::List-Cleanup=0)
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get -qq "${apt_opts[@]}" update
  $sudo apt-get -qq update  # the machine's own lists (empty on a fresh container): the build deps
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends \
    build-essential libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev \
    libreadline-dev uuid-dev dpkg-dev >/dev/null
  (cd "$work" && apt-get -qq "${apt_opts[@]}" source --download-only python3.13)
  (cd "$work" && tar xf python3.13_*.orig.tar.xz)
  src="$(find "$work" -maxdepth 1 -type d -name 'Python-3.13*' | head -1)"
  log="$cache/build.log"  # kept: its tail is printed when the build fails
  if ! (cd "$src" && ./configure --prefix="$prefix" --without-ensurepip >"$log" 2>&1 \
        && make -j"$(nproc)" >>"$log" 2>&1 && make install >>"$log" 2>&1); then
    tail -n 40 "$log"; echo "building CPython 3.13 failed: $log"; exit 1
  fi
  "$python" -m ensurepip --default-pip >/dev/null
  if ! "$python" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes, venv'; then
    echo "CPython 3.13 was built without a module pip or the tests need (see $log)"; exit 1
  fi
} >&2
echo "$python"
