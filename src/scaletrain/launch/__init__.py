"""The run's life before and around its workers: the config resolved against the world
(resolve), the run directory (rundir), torchrun's elastic agent (agent) and what the
console shows of it (output)."""
