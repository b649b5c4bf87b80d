"""The package's log lines (a skipped step, a decision) printed without breaking a progress bar.

With no logging configured, Python prints warnings through its last-resort handler straight to stderr, in the
middle of the tqdm bar Lightning draws on the same line ("Epoch 0:  40%|####  | 4/10 [...]step 4 skipped ...").
The handler below is attached to the ``lightning_mp`` logger and prints only when nothing else would (no handler
on the root logger): through ``tqdm.write``, which clears the bars, prints the line on its own and redraws them.
Configure logging (``logging.basicConfig``, Lightning's loggers, pytest's ``caplog``) and it steps aside: records
propagate to your handlers as usual.
"""

from __future__ import annotations

import logging
import sys


class _ProgressBarSafeHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().hasHandlers():
            return  # the root logger's handlers print it (records propagate)
        try:
            from tqdm import tqdm

            # sys.stderr at emit time: Rich's progress bar redirects it to print above its display
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def install() -> None:
    """Once per process (at import): the ``lightning_mp`` logger prints warnings without garbling progress bars, and
    ``lightning_mp.schedule`` (a precision schedule's switches, one line each on rank 0) its infos too."""
    for name, level in (("lightning_mp", logging.WARNING), ("lightning_mp.schedule", logging.INFO)):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _ProgressBarSafeHandler) for h in logger.handlers):
            logger.addHandler(_ProgressBarSafeHandler(level))
        if level < logging.WARNING and logger.level == logging.NOTSET:
            logger.setLevel(level)
