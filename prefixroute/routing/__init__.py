"""Pure routing logic: request parsing, block hashing, the prefix index and the scheduler.

Nothing here does I/O, so the same code runs in the live router (extproc) and in simulations (bench).
"""
