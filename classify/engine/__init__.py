"""How any model is trained: the one loop (``loop.fit``), the run folder it writes (``runfolder``,
``files``), settings and their flags (``config``), the optimizer and schedule (``optim``), the
device (``device``), torchrun (``distributed``) and the progress display (``progress``)."""
