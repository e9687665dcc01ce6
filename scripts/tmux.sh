#!/usr/bin/env bash
# Three panes (Trainer, Orchestrator, Inference) that follow OUTPUT_DIR/logs/*.log.
# Start the services in the panes yourself (uv run trainer|orchestrator|inference @ ...), or run `uv run rl`
# elsewhere: its services write the same logs, so the panes show them either way.
#   bash scripts/tmux.sh [-s SESSION] [-o OUTPUT_DIR]
set -euo pipefail

SESSION="prime-rl"
OUTPUT_DIR="${OUTPUT_DIR:-outputs}"
while getopts "s:o:h" opt; do
  case "$opt" in
    s) SESSION="$OPTARG" ;;
    o) OUTPUT_DIR="$OPTARG" ;;
    *) echo "usage: bash scripts/tmux.sh [-s SESSION] [-o OUTPUT_DIR]" >&2; exit 2 ;;
  esac
done

command -v tmux >/dev/null || { echo "tmux is not installed (apt-get install tmux)" >&2; exit 1; }
if tmux has-session -t "$SESSION" 2>/dev/null; then
  echo "tmux session '$SESSION' already exists; attach with: tmux attach -t $SESSION (or pick another -s)" >&2
  exit 1
fi

mkdir -p "$OUTPUT_DIR/logs"
follow() { echo "clear; echo '$1: tail -F $OUTPUT_DIR/logs/$2.log (Ctrl-C for a shell)'; tail -n 50 -F '$OUTPUT_DIR/logs/$2.log'"; }

tmux new-session -d -s "$SESSION" -n main -x 240 -y 60
tmux split-window -v -t "$SESSION:main"
tmux split-window -v -t "$SESSION:main"
tmux select-layout -t "$SESSION:main" even-vertical
tmux set-option -t "$SESSION" pane-border-status top
for i in 0 1 2; do
  name=$(echo Trainer Orchestrator Inference | cut -d' ' -f$((i + 1)))
  log=$(echo trainer orchestrator inference | cut -d' ' -f$((i + 1)))
  tmux select-pane -t "$SESSION:main.$i" -T "$name"
  tmux send-keys -t "$SESSION:main.$i" "export OUTPUT_DIR=$OUTPUT_DIR; $(follow "$name" "$log")" C-m
done

if [ -n "${TMUX:-}" ]; then tmux switch-client -t "$SESSION"; elif [ -t 1 ]; then tmux attach -t "$SESSION"; else
  echo "created tmux session '$SESSION'; attach with: tmux attach -t $SESSION"
fi
