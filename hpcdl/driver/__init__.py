"""The training driver: one loop for every strategy, and what the commands share.

``python -m hpcdl.train`` is the driver's command. It owns what every way of spreading
training shares: the config and the objects built from it (:mod:`.factory`), the run file
and its log (:mod:`.runlog`), checkpoints and ``--resume`` (:mod:`.checkpoints`), stop
signals (:mod:`.signals`), progress output (:mod:`.progress`), the launcher checks
(:mod:`.launch`) and the command-line plumbing of every command (:mod:`.cli`). A strategy
(:mod:`hpcdl.parallel`) owns the rest.
"""
