#!/usr/bin/env bash
# Create, set up and run posttrain on a Cloud TPU pod slice: one process per TPU VM host,
# every host running the same command; jax.distributed finds its peers from the TPU
# metadata (posttrain/distributed.py), so no coordinator flags are needed.
#
#   launch/tpu_pod.sh create NAME ZONE ACCELERATOR   # e.g. pt-v5p64 us-east5-a v5p-64
#   launch/tpu_pod.sh setup  NAME ZONE               # this checkout + deps on every host,
#                                                    # $BUCKET mounted at /mnt/ckpt if set
#   launch/tpu_pod.sh model  NAME ZONE HF_REPO DIR   # weights + tokenizer on every host
#                                                    # (not a repo's original/ or metal/
#                                                    # copies, as gpt-oss publishes)
#   launch/tpu_pod.sh train  NAME ZONE CONFIG WORKDIR [--config.k=v ...]
#   launch/tpu_pod.sh logs   NAME ZONE [WORKER]      # follow a host's log (default 0)
#   launch/tpu_pod.sh stop   NAME ZONE               # SIGTERM: checkpoint, then exit
#   launch/tpu_pod.sh ssh    NAME ZONE [WORKER]
#   launch/tpu_pod.sh delete NAME ZONE
#
# Environment: PROJECT (default: gcloud's), BUCKET (gs://... for checkpoints and metrics,
# mounted with gcsfuse at /mnt/ckpt on every host: Orbax needs one directory every host
# sees), RUNTIME (TPU software version; default picked from the accelerator), HF_TOKEN
# (gated models), SPOT=1 (spot capacity).
#
# WORKDIR must be on the shared mount (e.g. /mnt/ckpt/run1): every host writes its own
# checkpoint shards there and process 0 writes metrics. Re-running `train` with the same
# WORKDIR resumes from the newest complete checkpoint.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 3 ]] || usage
cmd=$1 name=$2 zone=$3
shift 3
project=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
root=$(cd "$(dirname "$0")/.." && pwd)
remote_dir='~/posttrain'
venv='~/posttrain-venv'
python="$venv/bin/python"

on_all() {  # Runs a shell command on every host of the slice at once.
  gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --project="$project" --worker=all \
    --command="$1"
}

case "$cmd" in
  create)
    [[ $# -ge 1 ]] || usage
    accel=$1
    case "$accel" in
      v5p-*) runtime=${RUNTIME:-v2-alpha-tpuv5} ;;
      v5litepod-*|v5e-*) runtime=${RUNTIME:-v2-alpha-tpuv5-lite}; accel=${accel/v5e-/v5litepod-} ;;
      v6e-*) runtime=${RUNTIME:-v2-alpha-tpuv6e} ;;
      v4-*) runtime=${RUNTIME:-tpu-ubuntu2204-base} ;;
      *) echo "error: unknown accelerator type $accel" >&2; exit 2 ;;
    esac
    gcloud compute tpus tpu-vm create "$name" --zone="$zone" --project="$project" \
      --accelerator-type="$accel" --version="$runtime" ${SPOT:+--spot}
    ;;
  setup)
    # Ship this checkout (committed files, as `git archive` sees them) to every host.
    tarball=$(mktemp /tmp/posttrain.XXXXXX.tar.gz)
    git -C "$root" archive --format=tar.gz -o "$tarball" HEAD
    gcloud compute tpus tpu-vm scp "$tarball" "$name":/tmp/posttrain.tar.gz --zone="$zone" \
      --project="$project" --worker=all
    rm -f "$tarball"
    mount=""
    if [[ -n "${BUCKET:-}" ]]; then
      # gcsfuse from Google's apt repository, then the bucket at /mnt/ckpt.
      mount="curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | \
          sudo gpg --batch --yes --dearmor -o /usr/share/keyrings/gcsfuse.gpg && \
        echo \"deb [signed-by=/usr/share/keyrings/gcsfuse.gpg] \
          https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | \
          sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null && \
        sudo apt-get -qq update && sudo apt-get -qq install -y gcsfuse && \
        sudo mkdir -p /mnt/ckpt && sudo chown \$USER /mnt/ckpt && \
        (mountpoint -q /mnt/ckpt || gcsfuse --implicit-dirs ${BUCKET#gs://} /mnt/ckpt) &&"
    fi
    # The TPU VM image's python is older than the package needs: uv brings Python 3.11.
    # The last line joins every host into one run and prints this host's place in it.
    on_all "set -e; mkdir -p $remote_dir && tar -xzf /tmp/posttrain.tar.gz -C $remote_dir && \
      cd $remote_dir && (command -v ~/.local/bin/uv || curl -LsSf https://astral.sh/uv/install.sh | sh) && \
      ~/.local/bin/uv venv --allow-existing --python 3.11 $venv && \
      ~/.local/bin/uv pip install --python $python -e '.[hf]' 'jax[tpu]>=0.10.0,<0.12' && \
      $mount $python -c 'from posttrain import distributed; print(distributed.maybe_initialize())'"
    ;;
  model)
    [[ $# -ge 2 ]] || usage
    repo=$1 dir=$2
    on_all "set -e; ~/.local/bin/uv pip install --python $python -q 'huggingface_hub[cli]' && \
      sudo mkdir -p $dir && sudo chown \$USER $dir && \
      ${HF_TOKEN:+HF_TOKEN=$HF_TOKEN} $venv/bin/huggingface-cli download $repo --local-dir $dir \
        --exclude 'original/*' --exclude 'metal/*'"
    ;;
  train)
    [[ $# -ge 2 ]] || usage
    config=$1 workdir=$2
    shift 2
    extra=$(printf ' %q' "$@")
    # nohup: the run outlives the ssh session; the pid file lets `stop` reach it.
    on_all "cd $remote_dir && nohup $python -m launch.train --config=$config \
      --workdir=$workdir $extra > ~/train.log 2>&1 < /dev/null & echo \$! > ~/train.pid"
    echo "started on every host; follow with: $0 logs $name $zone"
    ;;
  logs)
    gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --project="$project" \
      --worker="${1:-0}" --command="tail -n 100 -F ~/train.log"
    ;;
  stop)
    on_all 'test -f ~/train.pid && kill -TERM "$(cat ~/train.pid)" || true'
    ;;
  ssh)
    gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --project="$project" \
      --worker="${1:-0}"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --project="$project" --quiet
    ;;
  *) usage ;;
esac
