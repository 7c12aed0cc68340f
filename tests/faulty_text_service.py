"""`python -m tests.faulty_text_service`: the text service with a model runner that can be told to fail.

Each step sleeps `SPLITTTS_TEST_STEP_DELAY_S` (so requests stay in flight while a test acts); once
the file named by `SPLITTTS_TEST_FAULT_FILE` exists, every step raises, as a device fault would.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import servicekit  # noqa: F401  (torch backend auto-loading off before torch loads)
from text_service.__main__ import main
from text_service.model_runner import ModelRunner

_execute = ModelRunner.execute


def _faulty_execute(self, batch):
    time.sleep(float(os.environ.get("SPLITTTS_TEST_STEP_DELAY_S", "0")))
    if Path(os.environ["SPLITTTS_TEST_FAULT_FILE"]).exists():
        raise RuntimeError("injected device fault at 0x7f00deadbeef")
    return _execute(self, batch)


ModelRunner.execute = _faulty_execute

if __name__ == "__main__":
    sys.exit(main())
