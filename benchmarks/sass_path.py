"""Instructions one path through a kernel's main loop issues, counted from SASS on the CPU (no GPU).

Builds a kernel source of ``cuda_src/`` as NVRTC gets it (headers inlined, the contract generated) with
nvcc for one architecture and ``-D`` defines, disassembles one function with cuobjdump, and either lists
the conditional branches of its main loop (the longest backward branch) with the instructions before
each, or follows one path through the loop, taking each listed branch as told, and counts what it
issues. Needs nvcc, and cuobjdump with nvdisasm beside it: the CUDA toolkit's, or the
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels.

    python benchmarks/sass_path.py small_fc_lopt.cu small_fc_lopt_apply -D LOPT_SPLIT_MODE=2
    python benchmarks/sass_path.py small_fc_lopt.cu small_fc_lopt_apply -D LOPT_SPLIT_MODE=2 \\
        --take 0x2b60:T,0x3a50:T,0x3b40:T,0x3d90:F,...

The first form prints each branch as ``address  instruction  << the three before it``; read what each
tests and say, for the path wanted (a float32 factored matrix, say), whether it is taken (T) or not (F).
Addresses change with every build: list the branches again after a change.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lopt.fused import launcher  # noqa: E402

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"(@!?U?P\w+\s+)?BRA(?:\.U)?\s+(?:(!?U?P\w+), )?(0x[0-9a-f]+)")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for candidate in Path(root).glob("*/bin/cuobjdump"):
                return str(candidate)
    except ImportError:
        pass
    sys.exit("cuobjdump is not on PATH: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or put the CUDA "
             "toolkit's bin on PATH")


def disassemble(source: str, function: str, arch: str, defines: list[str]) -> list[tuple[int, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        unit, cubin = Path(tmp) / "unit.cu", Path(tmp) / "unit.cubin"
        unit.write_text(launcher.kernel_source(source))
        options = [o for o in launcher.NVRTC_OPTIONS if not o.startswith("--std")]
        subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", *options, *[f"-D{d}" for d in defines],
                        str(unit), "-o", str(cubin)], check=True)
        tool = cuobjdump()  # (it runs nvdisasm, from its own folder where the wheels put them)
        environment = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        sass = subprocess.run([tool, "-sass", "-fun", function, str(cubin)], check=True, capture_output=True,
                              text=True, env=environment).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]


def main_loop(code: list[tuple[int, str]]) -> tuple[int, int]:
    """(head, back edge) of the longest backward branch."""
    loops = [(int(m.group(3), 16), address) for address, text in code
             if (m := BRANCH.match(text)) and int(m.group(3), 16) < address]
    if not loops:
        sys.exit("the function has no loop")
    return max(loops, key=lambda loop: loop[1] - loop[0])


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def follow(code, head: int, back_edge: int, take: dict[int, bool]) -> list[tuple[int, str]]:
    index = {address: i for i, (address, _) in enumerate(code)}
    path, i = [], index[head]
    while True:
        address, text = code[i]
        if address == back_edge or len(path) > 20000:
            return path
        path.append((address, text))
        branch = BRANCH.match(text)
        if branch:
            target = int(branch.group(3), 16)
            if branch.group(1) is None and branch.group(2) is None:
                i = index[target]
                continue
            if address not in take:
                sys.exit(f"say whether the branch at {address:#x} ({text}) is taken: --take {address:#x}:T or :F")
            if take[address]:
                i = index[target]
                continue
        i += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a file of cuda_src/, e.g. small_fc_lopt.cu")
    parser.add_argument("function", help="the kernel, e.g. small_fc_lopt_apply")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, as the engine's defines")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--take", default="", help="the path: ADDRESS:T or ADDRESS:F for each conditional branch")
    parser.add_argument("--print", action="store_true", help="print the path's instructions")
    args = parser.parse_args()

    code = disassemble(args.source, args.function, args.arch, args.defines)
    head, back_edge = main_loop(code)
    print(f"{args.function}: {len(code)} instructions; main loop {head:#x} .. {back_edge:#x}")
    if not args.take:
        for i, (address, text) in enumerate(code):
            if head <= address < back_edge and text.startswith("@") and BRANCH.match(text):
                before = " | ".join(t for _, t in code[max(0, i - 3):i])
                print(f"{address:#x}  {text:<32}  << {before}")
        return 0
    take = {int(a, 16): v == "T" for a, v in (item.split(":") for item in args.take.split(","))}
    path = follow(code, head, back_edge, take)
    if args.print:
        for address, text in path:
            print(f"{address:#x}  {text}")
    histogram = collections.Counter(opcode(text) for _, text in path)
    print(f"{len(path)} instructions on the path (the back edge not counted)")
    print(", ".join(f"{name} {count}" for name, count in histogram.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
