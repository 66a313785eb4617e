"""Launching on clusters: mpirun command lines and the batch jobs' environment check
(:mod:`launch`), the emulated slow-network cluster (:mod:`netem`, root only) and a local Slurm on
it (:mod:`slurm_local`)."""
