"""pdflash: run Mixture-of-Experts models larger than the GPU.

Subpackages (one per top-level folder of the repository):

- ``pdflash.native``  the C priority-banded fetch scheduler and its Python wrapper
- ``pdflash.offload`` the offloaded expert runtime for gpt-oss (host store, device cache, prefetcher)
- ``pdflash.draft``   the DFlash block-diffusion drafter and speculative decoding
- ``pdflash.cli``     the ``pdflash`` command line
"""

__version__ = "0.1.0"


class PdflashError(Exception):
    """An expected failure with a message that tells the user what to do.

    The command line prints ``Error: <message>`` on stderr and exits with
    ``exit_code``; no traceback is shown unless PDFLASH_DEBUG=1.
    """

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class Interrupted(PdflashError):
    """The user interrupted the command (Ctrl-C) after it saved or printed what it could.

    The command line prints ``Interrupted: <message>`` on stderr and exits with 130.
    """

    exit_code = 130


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during token generation. Still a KeyboardInterrupt; ``token_ids`` holds the tokens
    generated (committed) before it, so a caller can show them."""

    def __init__(self, token_ids: list[int]):
        super().__init__(f"interrupted after {len(token_ids)} generated token(s)")
        self.token_ids = list(token_ids)
