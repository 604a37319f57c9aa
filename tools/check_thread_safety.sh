#!/usr/bin/env bash
# Clang's thread-safety analysis over knapserve's own sources: translation
# units under common/, executor/, planner/, tools/ and tests/ that
# BUILD_DIR/compile_commands.json lists are parsed by clang++ -fsyntax-only with
#   -Wthread-safety -Werror=thread-safety
# so a member marked ABSL_GUARDED_BY(mu_) touched without mu_, a helper marked
# ABSL_EXCLUSIVE_LOCKS_REQUIRED called without its lock, a lock taken twice or
# leaked, ... fails the check. Only annotated capability types are understood
# (absl::Mutex, absl::MutexLock, ...; libstdc++'s std::mutex is not annotated),
# which is why the project locks with Abseil's types. -Wthread-safety-beta
# (clang's experimental extra checks) is left out; it was clean too when this
# was written.
#
#   tools/check_thread_safety.sh [BUILD_DIR]              # the check (default: build)
#   tools/check_thread_safety.sh --all [BUILD_DIR]        # every translation unit
#   tools/check_thread_safety.sh --self-test [BUILD_DIR]  # proves the check can fail
#   tools/check_thread_safety.sh --no-cache [BUILD_DIR]   # ignore the cache below
#
# Which translation units: only those that can hold a finding, i.e. whose
# source or a project header it includes (transitively) mentions a mutex, a
# lock annotation or absl/synchronization: 38 of the 85 when this was written,
# tests included. --all checks every one.
#
# BUILD_DIR must be configured and built (the generated protobuf headers must
# exist). The build is GCC's, so each GCC command is translated for clang:
# -o/-c and dependency-file options dropped, the project's -W options replaced
# by the thread-safety ones. CMake's precompiled header (-include
# cmake_pch.hxx, whose GCC .gch clang cannot read) becomes a clang PCH built
# once per distinct command line (4 when this was written) and loaded with
# -include-pch, which cuts a LibTorch translation unit from ~8 s to ~3 s.
#
# LibTorch 1.13's headers do not compile with clang in C++20 mode as
# installed; tools/clang_libtorch_overlay.py says why and writes the patched
# header that is searched first.
#
# Cost, measured with JOBS=2 on a 2-core machine that other builds shared:
# the selection 211 CPU seconds (264 s wall at load 5; about 105 s on 2 idle
# cores), --all 283 CPU seconds (192 s wall); without the PCHs the selection
# took 360 CPU seconds. --self-test about 14 CPU seconds. Jobs run in
# parallel, JOBS at a time (default: nproc).
#
# A cache in BUILD_DIR/thread_safety_cache/ remembers the translation units
# that passed: one empty file per unit, named by the SHA-256 of clang's
# version, the unit's clang command line and its input: the content of every
# file the build's compile of it read (Ninja's record of GCC's -MD
# dependencies, system headers and the precompiled header's included), i.e.
# what its preprocessed text is made of. Where Ninja has no record, the
# preprocessed text itself (clang -E, about 1 CPU second a unit). A unit whose
# hash has a file is not analysed again, so a re-run after touching one .cc
# file analyses that file alone (and what includes a changed header); working
# out the keys takes about 2 s in all. A failure is never cached. Entries
# unused for 30 days are removed.
# KNAPSERVE_TSA_CACHE=0 (or --no-cache) analyses everything.
#
# clang++ comes from $CLANGXX, else clang++-14, else clang++ (tools/setup.sh
# installs Debian's clang). Exit status: 0 clean; 1 a thread-safety finding or
# a translation unit clang could not parse (its diagnostics are printed);
# 2 bad usage or no compile_commands.json; 77 no clang++ (CTest: skipped).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  echo "usage: $0 [--all | --self-test] [--no-cache] [BUILD_DIR]" >&2
  exit 2
}
self_test=0
check_all=0
use_cache="${KNAPSERVE_TSA_CACHE:-1}"
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --self-test) self_test=1 ;;
    --all) check_all=1 ;;
    --no-cache) use_cache=0 ;;
    *) usage ;;
  esac
  shift
done
[[ $# -le 1 ]] || usage
build_dir="$(cd "${1:-${repo}/build}" 2>/dev/null && pwd)" || {
  echo "check_thread_safety: no build directory ${1:-${repo}/build}" >&2
  exit 2
}
db="${build_dir}/compile_commands.json"
if [[ ! -f "${db}" ]]; then
  echo "check_thread_safety: ${db} is missing (configure with CMake first)" >&2
  exit 2
fi

clangxx="${CLANGXX:-}"
if [[ -z "${clangxx}" ]]; then
  for candidate in clang++-14 clang++; do
    if command -v "${candidate}" >/dev/null 2>&1; then
      clangxx="$(command -v "${candidate}")"
      break
    fi
  done
fi
if [[ -z "${clangxx}" ]]; then
  echo "check_thread_safety: no clang++ (install Debian's clang: tools/setup.sh); skipped" >&2
  exit 77
fi
jobs="${JOBS:-$(nproc)}"

work="$(mktemp -d "${TMPDIR:-/tmp}/knapserve_tsa.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

# Writes one shell script per clang run into $work/pch/ (the PCHs) and
# $work/tu/ (the translation units), listed in $work/pch.list and
# $work/tu.list; each script's first line names what it checks. Arguments:
# repo, compile_commands.json, work dir, clang++, 1 for every translation unit
# (0: only those that mention locking), the cache folder ("" for none), then
# for the self-test the sources to check instead, with the flags of a project
# translation unit. A unit found in the cache gets no job; each job's cache
# key is written beside its script (NNNN.key).
make_jobs() {
  python3 - "$@" <<'PY'
import collections, json, os, re, shlex, sys

import concurrent.futures, hashlib, subprocess, time

repo, db_path, work, clangxx, check_all, cache_dir = sys.argv[1:7]
check_all = check_all == "1"
self_test_sources = sys.argv[7:]
ours = ("common/", "executor/", "planner/", "tools/", "tests/")
warnings = ["-Qunused-arguments", "-Wno-unknown-warning-option", "-Wthread-safety",
            "-Werror=thread-safety"]

# pytorch/pytorch#97689 (see the script's header): a patched List.h, if the
# installed one has the two functions clang rejects in C++20.
sys.path.insert(0, os.path.join(repo, "tools"))
from clang_libtorch_overlay import write_overlay
overlay = []
if write_overlay(os.path.join(work, "overlay")):
    overlay = ["-isystem", os.path.join(work, "overlay")]


def translate(entry):
    """(directory, clang arguments without the source, the -include'd headers)."""
    directory = entry["directory"]
    args = entry.get("arguments") or shlex.split(entry["command"])
    source = os.path.normpath(os.path.join(directory, entry["file"]))
    out, includes = [clangxx] + overlay, []
    i = 1
    while i < len(args):
        a = args[i]
        i += 1
        if a in ("-o", "-MF", "-MT", "-MQ"):
            i += 1
        elif a in ("-c", "-MD", "-MMD", "-fpch-preprocess"):
            pass
        elif (a.startswith("-W") and not a.startswith(("-Wl,", "-Wp,", "-Wa,"))) or a == "-w":
            pass  # the project's warnings are GCC's business; only ours below
        elif a == "-include" and i < len(args):
            includes.append(os.path.normpath(os.path.join(directory, args[i])))
            i += 1
        elif os.path.normpath(os.path.join(directory, a)) == source:
            pass
        else:
            out.append(a)
    return directory, out + warnings, includes


# Whether a file, or a project header it includes (transitively), mentions a
# mutex, a lock annotation or Abseil's synchronization: only such translation
# units can hold a finding.
locking = re.compile(r"absl/synchronization/|thread_annotations|[Mm]utex|GUARDED_BY|"
                     r"LOCKS_(REQUIRED|EXCLUDED)|ACQUIRE|RELEASE")
include_line = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
memo = {}


def mentions_locking(path):
    if path not in memo:
        memo[path] = False  # an include cycle adds nothing
        try:
            text = open(path, errors="replace").read()
        except OSError:
            return False
        found = bool(locking.search(text))
        for name in ([] if found else include_line.findall(text)):
            for base in (repo, os.path.dirname(path)):
                candidate = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(candidate):
                    found = mentions_locking(candidate)
                    break
            if found:
                break
        memo[path] = found
    return memo[path]


units = []  # (name, source, compile_commands entry)
seen = set()
for entry in json.load(open(db_path)):
    path = os.path.normpath(os.path.join(entry["directory"], entry["file"]))
    rel = os.path.relpath(path, repo)
    if not rel.startswith(ours) or path in seen:
        continue
    seen.add(path)
    if check_all or self_test_sources or mentions_locking(path):
        units.append((rel, path, entry))
units.sort(key=lambda u: u[0])
if not units:
    sys.exit("check_thread_safety: compile_commands.json lists no project sources")
open(os.path.join(work, "tu.list"), "w").close()
if self_test_sources:
    # Borrow the flags of a translation unit that includes LibTorch through
    # the precompiled header, so the self-test takes the whole path.
    pch_units = [u for u in units if translate(u[2])[2]]
    entry = (pch_units or units)[0][2]
    units = [(os.path.basename(s), s, entry) for s in self_test_sources]

def textual(includes):
    # As text behind -Xclang: the driver would pick up GCC's .gch beside it.
    return [x for inc in includes for x in ("-Xclang", "-include", "-Xclang", inc)]


clang_version = ""
if cache_dir:
    clang_version = subprocess.run([clangxx, "--version"], capture_output=True,
                                   text=True).stdout
    # The overlay's patched header is written by this script: its source is
    # part of every unit's input.
    clang_version += open(os.path.join(repo, "tools", "clang_libtorch_overlay.py")).read()


def ninja_deps(build_dir):
    """{object path: [files]} from Ninja's record of what each compile read
    (GCC's -MD: the source and every header, system headers included), or
    {} without Ninja."""
    try:
        out = subprocess.run(["ninja", "-C", build_dir, "-t", "deps"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    deps, current = {}, None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            current = line.split(":", 1)[0]
            deps[current] = []
        elif line.strip() and current is not None:
            deps[current].append(line.strip())
    return deps


file_digests = {}


def file_digest(path):
    if path not in file_digests:
        try:
            with open(path, "rb") as f:
                file_digests[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            file_digests[path] = "missing"
    return file_digests[path]


def output_of(entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    for i, a in enumerate(args[:-1]):
        if a == "-o":
            return args[i + 1]
    return None


deps_by_output = ninja_deps(os.path.dirname(db_path)) if cache_dir else {}


def cache_key(unit):
    """SHA-256 of clang's version, the command line and the unit's input.
    The input is every file the build's compile of the unit read (Ninja's
    deps, and those of its precompiled header), by content, which is what its
    preprocessed text is made of; without them, the preprocessed text itself
    (clang -E, about 1 CPU second). None when neither can be had (the unit is
    then analysed)."""
    name, source, entry = unit
    directory, args, includes = translate(entry)
    digest = hashlib.sha256()
    digest.update(clang_version.encode())
    # The overlay lives in this run's temporary folder: its path must not
    # make every key new (the overlay's content is in clang_version).
    stable = [a.replace(work, "<work>") for a in args + textual(includes)]
    digest.update("\0".join(stable + [source]).encode())
    output = output_of(entry)
    files = deps_by_output.get(output) if output else None
    build_dir = os.path.dirname(db_path)
    if files:
        files = list(files)
        for inc in includes:  # CMake's PCH: the headers read when it was made
            pch = os.path.relpath(inc + ".gch", build_dir)
            if pch not in deps_by_output:
                files = None
                break
            files += deps_by_output[pch]
    if files:
        # Ninja's paths are absolute or relative to the build folder.
        for f in sorted(set(os.path.normpath(os.path.join(build_dir, f)) for f in files)):
            digest.update(("\0%s\0%s" % (f, file_digest(f))).encode())
        return digest.hexdigest()
    proc = subprocess.Popen(args + textual(includes) + ["-E", source], cwd=directory,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for chunk in iter(lambda: proc.stdout.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest() if proc.wait() == 0 else None


keys = {}
if cache_dir and not self_test_sources:
    os.makedirs(cache_dir, exist_ok=True)
    jobs = int(os.environ.get("JOBS") or os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        keys = dict(zip((u[0] for u in units), pool.map(cache_key, units)))
    hits = [u for u in units
            if keys[u[0]] and os.path.exists(os.path.join(cache_dir, keys[u[0]]))]
    now = time.time()
    for name, _, _ in hits:
        os.utime(os.path.join(cache_dir, keys[name]), (now, now))
    for old in os.listdir(cache_dir):
        path = os.path.join(cache_dir, old)
        if now - os.path.getmtime(path) > 30 * 86400:
            os.remove(path)
    hit_names = {u[0] for u in hits}
    units = [u for u in units if u[0] not in hit_names]
    with open(os.path.join(work, "cached.count"), "w") as f:
        f.write("%d\n" % len(hits))

# Translation units with one -include and the same command line share a PCH
# of it (when two or more do, or in the self-test).
translated = []
groups = collections.Counter()
for name, source, entry in units:
    directory, args, includes = translate(entry)
    key = (tuple(args), tuple(includes)) if len(includes) == 1 else None
    translated.append((name, source, directory, args, includes, key))
    if key is not None:
        groups[key] += 1
pchs = {}
for d in ("pch", "tu"):
    os.makedirs(os.path.join(work, d))


def write_job(kind, n, name, directory, cmd):
    script = os.path.join(work, kind, "%04d.sh" % n)
    with open(script, "w") as f:
        f.write("# %s\ncd %s && exec %s\n" % (name, shlex.quote(directory), shlex.join(cmd)))
    if keys.get(name):
        with open(os.path.join(work, kind, "%04d.key" % n), "w") as f:
            f.write(keys[name] + "\n")
    with open(os.path.join(work, kind + ".list"), "a") as listing:
        listing.write(script + "\n")


open(os.path.join(work, "pch.list"), "w").close()
for n, (name, source, directory, args, includes, key) in enumerate(translated):
    if key is not None and (groups[key] >= 2 or self_test_sources):
        if key not in pchs:
            k = len(pchs)
            # Included from a wrapper, so its "#pragma GCC system_header" applies.
            wrapper = os.path.join(work, "pch", "%04d.hxx" % k)
            with open(wrapper, "w") as f:
                f.write('#include "%s"\n' % includes[0])
            pchs[key] = os.path.join(work, "pch", "%04d.pch" % k)
            write_job("pch", k, "PCH of " + os.path.relpath(includes[0], repo), directory,
                      args + ["-x", "c++-header", wrapper, "-o", pchs[key]])
        prefix = ["-include-pch", pchs[key]]
    else:
        prefix = textual(includes)
    write_job("tu", n, name, directory, args + prefix + ["-fsyntax-only", source])
PY
}

# Runs the jobs of $work/$1.list, JOBS at a time; prints the diagnostics of
# those that failed and a summary line. Returns 0 when all passed.
run_jobs() {
  local list="${work}/$1.list" count failed=0 script findings
  count="$(wc -l <"${list}")"
  if [[ "${count}" -eq 0 ]]; then
    [[ "$1" == pch ]] || echo "check_thread_safety: no translation unit to analyse"
    return 0
  fi
  # shellcheck disable=SC2016
  xargs -a "${list}" -d '\n' -P "${jobs}" -n 1 \
    bash -c 'bash "$1" >"${1%.sh}.log" 2>&1 || touch "${1%.sh}.failed"' _
  while read -r script; do
    [[ -e "${script%.sh}.failed" ]] || continue
    failed=$((failed + 1))
    echo "=== $(head -1 "${script}" | cut -c3-)"
    cat "${script%.sh}.log"
  done <"${list}"
  findings="$(cat "${work}/$1"/*.log 2>/dev/null | grep -c -- '-Wthread-safety' || true)"
  if [[ "$1" == pch ]]; then
    echo "check_thread_safety: ${count} precompiled headers, ${failed} failed"
  else
    echo "check_thread_safety: ${count} translation units, ${failed} failed," \
         "${findings} thread-safety findings (${clangxx})"
  fi
  [[ "${failed}" -eq 0 ]]
}

if [[ "${self_test}" -eq 0 ]]; then
  start=${SECONDS}
  cache_dir=""
  [[ "${use_cache}" == 0 ]] || cache_dir="${build_dir}/thread_safety_cache"
  make_jobs "${repo}" "${db}" "${work}" "${clangxx}" "${check_all}" "${cache_dir}"
  if [[ -f "${work}/cached.count" ]]; then
    echo "check_thread_safety: $(cat "${work}/cached.count") translation units unchanged" \
         "since they passed (${cache_dir}); KNAPSERVE_TSA_CACHE=0 analyses them too"
  fi
  status=0
  if run_jobs pch; then
    run_jobs tu || status=1
  else
    status=1
  fi
  # Remember the units that passed.
  while read -r script; do
    [[ -n "${cache_dir}" && -e "${script%.sh}.key" && ! -e "${script%.sh}.failed" ]] || continue
    : >"${cache_dir}/$(cat "${script%.sh}.key")"
  done <"${work}/tu.list"
  echo "check_thread_safety: $((SECONDS - start)) s with ${jobs} jobs"
  exit "${status}"
fi

# --self-test: a member guarded by a mutex, written with and without it, both
# checked the way project sources are. The clean one must pass and the
# violating one must fail, naming the member.
cat >"${work}/tsa_clean.cc" <<'CC'
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace {

class Counter {
 public:
  void Add() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ++value_;
  }
#ifdef TSA_SELF_TEST_VIOLATION
  void AddUnlocked() { ++value_; }  // writes value_ without mu_
#endif

 private:
  absl::Mutex mu_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

void TsaSelfTest() { Counter().Add(); }
CC
{
  echo '#define TSA_SELF_TEST_VIOLATION'
  cat "${work}/tsa_clean.cc"
} >"${work}/tsa_violation.cc"

make_jobs "${repo}" "${db}" "${work}" "${clangxx}" 0 "" "${work}/tsa_clean.cc" \
  "${work}/tsa_violation.cc"
run_jobs pch || exit 1
run_jobs tu || true  # the violation must fail; judged below
clean_log="${work}/tu/0000.log"
violation_log="${work}/tu/0001.log"
if [[ -e "${work}/tu/0000.failed" ]]; then
  echo "check_thread_safety --self-test: FAIL: the correctly locked snippet was flagged" >&2
  exit 1
fi
if [[ ! -e "${work}/tu/0001.failed" ]]; then
  echo "check_thread_safety --self-test: FAIL: an unguarded write was not flagged" >&2
  exit 1
fi
if ! grep -q "writing variable 'value_' requires holding mutex 'mu_'" "${violation_log}"; then
  echo "check_thread_safety --self-test: FAIL: the check failed for another reason" >&2
  exit 1
fi
[[ ! -s "${clean_log}" ]] || cat "${clean_log}"
echo "check_thread_safety --self-test: OK (clean snippet passes, unguarded write fails)"
