"""Imported last by the forkserver fastload starts (see ``fastload._workers``): moves everything the
forkserver preloaded (torch, numpy, fastload) out of the garbage collector's reach, so a worker's
full collection does not touch, and so copy, every page it shares with the forkserver."""

import gc

gc.freeze()
