#!/usr/bin/env bash
# Wheels of the project's dependencies and of the check's own runner (pytest, pytest-timeout) that a GPU image
# without a package index lacks, into .whl/ (git-ignored), for tests/gpu/check.sh to install there into a scratch
# folder. Run on a machine that reaches PyPI:
#
#   bash tests/gpu/wheels.sh              # CPython 3.12, manylinux x86-64 (PYV=3.11 for another)
#
# The image is assumed to hold torch, numpy, pandas, scikit-learn, matplotlib, rich, nvidia-ml-py and
# the other common packages; wheels of those are dropped after the download so that none shadows the
# image's own build (torch above all).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV="${PYV:-3.12}"
rm -rf .whl && mkdir -p .whl
plats=()
for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
# omegaconf's parser runtime ships as an sdist only: build its (pure Python) wheel here first.
python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
python3 -m pip download -q --find-links .whl --only-binary=:all: --python-version "$PYV" --implementation cp "${plats[@]}" \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  "hydra-core>=1.3" "omegaconf>=2.3" "submitit>=1.5" "mlflow>=2.10" "pytest>=7" "pytest-timeout>=2.2"
image_has='^(torch|numpy|pandas|scipy|scikit_learn|matplotlib|pyarrow|pillow|contourpy|fonttools|kiwisolver|cycler|pyparsing|python_dateutil|six|pytz|tzdata|jinja2|markupsafe|requests|urllib3|idna|certifi|charset_normalizer|packaging|pyyaml|PyYAML|protobuf|click|cloudpickle|typing_extensions|joblib|threadpoolctl|rich|markdown_it_py|mdurl|pygments|nvidia_ml_py|psutil|filelock|fsspec|sympy|mpmath|networkx|triton|nvidia_.*|setuptools|attrs|anyio|h11|httpcore|httpx|sniffio|werkzeug|markdown|grpcio|zipp|wrapt|aiohttp|aiohappyeyeballs|aiosignal|frozenlist|multidict|propcache|yarl|narwhals|annotated_doc)-'
for w in .whl/*.whl; do
  if basename "$w" | grep -Eiq "$image_has"; then rm -f "$w"; fi
done
for need in pytest- pytest_timeout- pluggy- iniconfig- hydra_core- omegaconf- submitit- mlflow-; do
  compgen -G ".whl/${need}*.whl" >/dev/null || { echo "wheels.sh: no ${need%-} wheel in .whl/" >&2; exit 1; }
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry .whl with the working tree)"
