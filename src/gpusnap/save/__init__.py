"""The save path behind :class:`~gpusnap.Checkpointer` (a facade over it).

A save, in call order (each step raises before the next starts):

1. tiers (``tiers.py``): where it commits, the durable root or the fast tier, and the room
   it reserves there (``fast_room.py``);
2. plan (``planner.py``): Config, what earlier saves taught the capture history and the
   device's free memory make one frozen :class:`~gpusnap.save.planner.CapturePlan`;
3. engine (``saves.py`` on the caller's thread, ``engine.py`` behind it): flatten, open the
   capture window (``windows.py``), queue the job for the writer thread;
4. capture (:mod:`gpusnap.capture`): the consistent point, the copies, validation;
5. commit (``commit.py``): chunks stored, the manifest committed; a save that failed
   validation is retried once, on the thread that saved (``retries.py``);
6. after-commit (``commit.py``, ``promotion.py``): retention, promotion to the durable root.

Failures nothing observed are raised later (``unobserved.py``); close, interpreter exit and
SIGTERM are ``lifecycle.py``'s.
"""
