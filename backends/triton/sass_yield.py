"""Let the promotion's FP32 instructions of a compiled Hopper kernel yield the warp scheduler: a
rewrite of two control bits in the cubin that ptxas wrote.

Why: in the blockwise fp8 kernels each math warp promotes a K block's partial product with a
burst of 64-128 back-to-back FFMA/FMUL instructions right after its wgmma wait. ptxas marks each
of them as not yielding, so the scheduler of an SM sub-partition may keep issuing one warp's
burst while the other math warpgroup's warp on that sub-partition waits to issue its next wgmma,
and the tensor cores idle. DeepGEMM reported 10%+ for fine-grained-scaling fp8 GEMMs from
flipping the yield bit (and, with it, clearing the register-reuse flags) on part of such a burst.

The facts used (sm_90 encoding, the second 64-bit word of each 128-bit instruction): bit 45 is the
yield flag, set by ptxas on ordinary instructions and cleared where the scheduler may switch warps
after the instruction; bits 58-61 are the operand-reuse flags. An instruction that yields must not
leave an operand in the reuse cache for the next one (another warp may run in between), so its
reuse flags are cleared too; clearing them is always safe (the operand is read from the register
file again). Nothing else changes: the same instructions, registers and dependences.

``patch_cubin`` finds the bursts in ``cuobjdump -sass`` output (the tool Triton bundles), maps each
instruction to its bytes through the cubin's ELF section table, checks the bytes match what the
disassembly printed, and rewrites the chosen ones. ``patch_kernel`` applies it to a Triton
``CompiledKernel`` (reloading its module if it was already loaded).

>>> patched, changed = patch_cubin(cubin_bytes)  # doctest: +SKIP
"""
from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass

#: Second-word masks: the yield flag (bit 45 of the second word) and the four reuse flags.
YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
#: A burst is at least this many consecutive promotion instructions.
MIN_BURST = 16

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/")
_SECOND = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


@dataclass(frozen=True)
class Instr:
    """One disassembled instruction: its byte offset in the function, text, and two words."""

    offset: int
    text: str
    low: int
    high: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def disassemble(cubin: bytes) -> dict[str, list[Instr]]:
    """Function name -> its instructions in order, from the bundled ``cuobjdump -sass``."""
    tool = _cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    functions: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Function :" in line:
            current = functions.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = _INSTR.search(line)
        if m and current is not None and i + 1 < len(lines):
            second = _SECOND.match(lines[i + 1])
            if second:
                current.append(Instr(int(m.group(1), 16), m.group(2), int(m.group(3), 16), int(second.group(1), 16)))
    return functions


def bursts(instrs: list[Instr], opcodes: tuple[str, ...] = ("FFMA", "FMUL")) -> list[list[Instr]]:
    """Runs of at least ``MIN_BURST`` consecutive instructions whose opcode is in ``opcodes``."""
    runs, run = [], []
    for ins in instrs + [Instr(-1, "END", 0, 0)]:
        if ins.opcode in opcodes:
            run.append(ins)
            continue
        if len(run) >= MIN_BURST:
            runs.append(run)
        run = []
    return runs


def text_sections(cubin: bytes) -> dict[str, int]:
    """Section name -> file offset of every ``.text.*`` section of an ELF64 little-endian cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("sass_yield: not an ELF64 little-endian cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, _size in headers:
        end = cubin.index(b"\0", strtab + name_off)
        name = cubin[strtab + name_off:end].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = offset
    return out


def patch_cubin(cubin: bytes, opcodes: tuple[str, ...] = ("FFMA",), fraction: float = 9 / 16,
                every: int = 1) -> tuple[bytes, int]:
    """``cubin`` with the yield flag cleared (and the reuse flags with it) on the first
    ``fraction`` of each burst of ``opcodes`` instructions, every ``every``-th one; and the count
    changed. Raises ValueError where the disassembly and the bytes disagree (nothing is written
    then)."""
    out = bytearray(cubin)
    sections = text_sections(cubin)
    changed = 0
    for name, instrs in disassemble(cubin).items():
        if name not in sections:
            raise ValueError(f"sass_yield: no .text section for function {name}")
        base = sections[name]
        for run in bursts(instrs, opcodes):
            for k, ins in enumerate(run[:int(len(run) * fraction)]):
                if k % every or not ins.high & YIELD_BIT:
                    continue
                at = base + ins.offset
                if struct.unpack_from("<QQ", out, at) != (ins.low, ins.high):
                    raise ValueError(f"sass_yield: bytes at {name}+{ins.offset:#x} differ from the disassembly")
                struct.pack_into("<Q", out, at + 8, ins.high & ~(YIELD_BIT | REUSE_BITS))
                changed += 1
    return bytes(out), changed


def patch_kernel(kernel, **options) -> int:
    """Rewrites the cubin of a Triton ``CompiledKernel`` with ``patch_cubin(**options)``; a kernel
    already loaded is loaded again from the new bytes at its next launch. Returns the count of
    instructions changed."""
    patched, changed = patch_cubin(kernel.asm["cubin"], **options)
    load_cubin(kernel, patched)
    return changed


def load_cubin(kernel, cubin: bytes) -> None:
    """Makes a Triton ``CompiledKernel`` launch ``cubin`` from its next launch on (a module
    already loaded stays loaded, unused)."""
    kernel.asm["cubin"] = cubin
    kernel.kernel = cubin
    kernel.module = None  # _init_handles loads the module again at the next launch
    kernel._run = None


def _cuobjdump() -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise ValueError(f"sass_yield: Triton's bundled cuobjdump is not at {tool}")
    return tool


__all__ = ["Instr", "bursts", "disassemble", "load_cubin", "patch_cubin", "patch_kernel", "text_sections"]
