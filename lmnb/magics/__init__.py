"""IPython magics: `%lmnb` (the kernel's runtime) and `%%lmprogram` (cells as lmnb programs).

Imported only by `%load_ext lmnb`; the engine itself (torch) loads on the first model load.
"""

from lmnb.magics.errors import LMProgramError, LMProgramInterrupted
from lmnb.magics.extension import load, unload
from lmnb.magics.magics import LMNB
from lmnb.magics.result import ProgramResult
