#!/usr/bin/env bash
# Build llama.cpp's peer tools (llama-bench, llama-batched-bench, llama-server, llama-quantize) from the
# llama-cpp-python 0.3.36 source distribution (PyPI), for side-by-side benchmarks on the same GGUF file.
# About 18 minutes of 2-core build time the first time; idempotent.
#
#   benchmarks/peers/build_llamacpp.sh [HF_DIR] [WORK_DIR=/tmp/peers] [PYTHON=.venv/bin/python]
#
# Prints the directory holding the binaries. With HF_DIR, also converts that Hugging Face directory to
# f32, Q8_0 and Q4_0 GGUFs beside it (HF_DIR-{f32,Q8_0,Q4_0}.gguf); the real models already ship as GGUF
# files, so their comparisons need no HF_DIR.
#
# Which build: not GGML_NATIVE. A native build compiles ggml's AMX kernels on an AMX CPU, and those die
# with SIGILL in `tinygemm_kernel_amx` on the AMX Xeon this project measured (the OS had not granted the
# tile state). So every instruction set the CPU reports is switched on one by one, AMX stays off, and the
# CPU repack (GGML_CPU_REPACK, llama.cpp's normal fast path) stays on. The flags used are written to
# BIN_DIR/kvserve-build.txt; benchmarks/gguf_vs_llamacpp.py copies that line into its JSON, so every table
# says which build it used. (The project's copy of the script the benchmarks were first run with; this one
# also records the build and makes HF_DIR optional.)
set -eu
hf=${1:-}; work=${2:-/tmp/peers}; py=${3:-.venv/bin/python}
src=$work/llama_cpp_python-0.3.36/vendor/llama.cpp
bin=$src/build/bin
mkdir -p "$work"
isa=""; flags=$(grep -m1 '^flags' /proc/cpuinfo)
for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
         avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  case " $flags " in *" ${f%%:*} "*) isa="$isa -DGGML_${f#*:}=ON";; *) isa="$isa -DGGML_${f#*:}=OFF";; esac
done
options="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF$isa"
if [ ! -x "$bin/llama-bench" ]; then
  (cd "$work" && pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d . \
     && tar xzf llama_cpp_python-0.3.36.tar.gz)
  (cd "$src" && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release $options -DLLAMA_CURL=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF >/dev/null \
     && cmake --build build -j 2 --target llama-bench llama-batched-bench llama-server llama-quantize >/dev/null)
  echo "llama.cpp from llama-cpp-python 0.3.36; cmake $options; CPU repack on" > "$bin/kvserve-build.txt"
fi
if [ -n "$hf" ]; then
  "$py" -c "import sentencepiece, gguf" 2>/dev/null || "$(dirname "$py")/pip" install -q sentencepiece "$src/gguf-py"
  f32=${hf%/}-f32.gguf
  [ -f "$f32" ] || "$py" "$src/convert_hf_to_gguf.py" "$hf" --outtype f32 --outfile "$f32" >/dev/null 2>&1
  for t in Q8_0 Q4_0; do
    out=${hf%/}-$t.gguf
    [ -f "$out" ] || "$bin/llama-quantize" "$f32" "$out" "$t" >/dev/null 2>&1
  done
fi
echo "$bin"
