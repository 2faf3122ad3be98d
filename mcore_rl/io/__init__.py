"""Safety machinery shared by every command that reads checkpoints or writes folders.

- :mod:`~mcore_rl.io.errors`: the expected failures (one line each, naming the item) and ``note``;
- :mod:`~mcore_rl.io.output`: :class:`~mcore_rl.io.output.OutputFolder`, output folders that appear only
  complete (exclusive staging, fsync, a commit that never replaces a concurrent writer's output or a folder
  that is not ours), with stale staging of killed runs cleaned on the next run;
- :mod:`~mcore_rl.io.signals`: SIGTERM/SIGINT/SIGHUP become an exception, so cleanup runs;
- :mod:`~mcore_rl.io.inputs`: files of an input folder, never followed through a symlink out of it;
- :mod:`~mcore_rl.io.checkpoint_read`: DCP metadata through a restricted unpickler, checkpoint objects
  with ``weights_only=True``.

Trust model (also in the README): input folders are data, never code. Nothing a checkpoint carries is
unpickled except through an allow-list, and no file outside an input folder is read because of a link in it.
"""
