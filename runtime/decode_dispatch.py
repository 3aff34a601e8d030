"""`DecodeDispatcher`: a decode step finds its compiled program by one lookup on its signature.

The decode boundary (`DecodeRuntime.prepare`) builds each step's frozen `DecodeSignature`
once; the eager and the traced executor of a lane look the step's program up here by that
value, as a graph dispatcher looks a captured graph up by a frozen batch descriptor. The
digest (`ProgramKey`, SHA-256 of the canonical key material) is computed once per signature,
on its first lookup, by the `ProgramCompiler`, which stays the one registry of compiled
programs and checks digest collisions then. Programs are never un-compiled, so a found
program is kept; a signature not compiled yet is asked about again on its next lookup.
"""

from __future__ import annotations

from runtime.decode_signatures import DecodeSignature
from runtime.program_compiler import CompiledProgram, ProgramCompiler

__all__ = ["DecodeDispatcher"]


class DecodeDispatcher:
    """The lane's compiled decode programs by signature (shared by both executors)."""

    def __init__(self, program_compiler: ProgramCompiler) -> None:
        self._compiler = program_compiler
        self._programs: dict[DecodeSignature, CompiledProgram] = {}

    def program(self, signature: DecodeSignature) -> CompiledProgram | None:
        """The compiled program of `signature`, or None when it was never compiled."""
        program = self._programs.get(signature)
        if program is None:
            program = self._compiler.program_for(signature)
            if program is not None:
                self._programs[signature] = program
        return program
