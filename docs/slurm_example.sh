#!/bin/bash
# RepLKNet-31B on ImageNet-1K over 2 nodes x 8 GPUs through Lightning's SLURM support (docs/training_multigpu.md).
#   sbatch docs/slurm_example.sh                 (edit the #SBATCH lines, DATA and the venv path first)
# srun starts one task per GPU; Lightning reads SLURM's variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODELIST...),
# so it launches no processes itself. --ntasks-per-node must equal trainer.devices and --nodes trainer.num_nodes.
#SBATCH --job-name=replknet31b-in1k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=SIGUSR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# --signal: two minutes before the time limit SLURM sends SIGUSR1; Lightning then saves
# <run>/hpc_ckpt_<n>.ckpt and requeues the job, which resumes from that checkpoint (same job id, same run folder).

set -euo pipefail
cd "${SLURM_SUBMIT_DIR}"
source .venv/bin/activate
DATA=/data/imagenet                          # train/<wnid>/*.JPEG and val/<wnid>/*.JPEG

# Global batch = data.batch_size (per GPU) x GPUs = 64 x 16 = 1024; with optim.lr_base_batch=2048 the recipe's
# lr 4e-3 becomes 2e-3. trainer.accumulate_grad_batches=2 would restore the recipe's 2048 (and lr 4e-3).
# hydra.run.dir is pinned to the job id: every task and every requeue of the job write to one folder (a
# ${now:...} folder could differ between tasks by a second, and a requeue would start a new one).
srun python train.py experiment=replknet31b_in1k data.root="${DATA}" \
    trainer.num_nodes="${SLURM_JOB_NUM_NODES}" trainer.devices="${SLURM_NTASKS_PER_NODE}" \
    data.num_workers="${SLURM_CPUS_PER_TASK}" \
    'logger=[csv,wandb]' 'callbacks=[default,throughput]' \
    hydra.run.dir="outputs/slurm/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"

# A sweep (e.g. the kernel-size ablation) runs the same way: every task walks the same sweep in step, so pin the
# sweep folder instead:
#   srun python train.py -m experiment=kernel_ablation model=replknet31b data=imagenet data.root="${DATA}" \
#       trainer=ddp trainer.num_nodes="${SLURM_JOB_NUM_NODES}" trainer.devices="${SLURM_NTASKS_PER_NODE}" \
#       hydra.sweep.dir="outputs/multirun/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"
