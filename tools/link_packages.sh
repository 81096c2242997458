#!/usr/bin/env bash
# Links mokv's Python packages of a checkout into a site directory, as pyproject's
# package-dir names them, so that mokv finds its Mojo sources beside them (as an
# editable install does): the GPU proof's install (tools/gpu_proof.sh) and the
# previous kernels' checkout copy of tools/gpu_warm_cache.sh.
#
# Usage: tools/link_packages.sh SITE CHECKOUT
set -euo pipefail
site=$1 checkout=$2
ln -sfn "$checkout/python/mokv" "$site/mokv"
ln -sfn "$checkout/graphs" "$site/mokv_models"
ln -sfn "$checkout/examples" "$site/mokv_examples"
ln -sfn "$checkout/reference" "$site/mokv_reference"
