"""Launching ranks: the environment a launcher (torchrun, srun) gives a rank, and SLURM scripts."""
