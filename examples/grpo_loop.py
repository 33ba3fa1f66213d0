"""An RL loop driving megatrain's step: completions sampled elsewhere (here HF ``generate`` on a copy of the weights,
in practice vLLM or SGLang), a reward per completion, group-relative advantages as GRPO computes them, and one
megatrain step on the completions weighted by them (``objective=SequenceWeights()``).

On-policy GRPO without a KL term: each completion's advantage A (its reward minus its group's mean, over the group's
standard deviation) divided by its length weights its log-probability sum, so the step's loss is minus the mean
over completions of A times the mean of its tokens' log-probabilities -- GRPO's gradient where the sampling policy is
the one being trained. The weights then go back to the sampler (``copy_to``).

    python examples/grpo_loop.py [--iterations 5] [--model DIR]

The reward here is a toy (how many of a completion's tokens are the letter-like token the run picks), so a tiny
random model learns it in a few iterations; replace ``reward`` with a verifier or a reward model.
"""

from __future__ import annotations

import argparse
import copy

import torch


def reward(completion: list[int], target: int) -> float:
    return sum(t == target for t in completion) / max(1, len(completion))


def main(argv: list[str] | None = None) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import megatrain
    from megatrain.objectives import SequenceWeights
    from megatrain.runtime.optim import OptimConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model directory (default: a tiny random Llama)")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.model:
        sampler = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        cfg = AutoConfig.for_model(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                   max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                                   eos_token_id=None, bos_token_id=None)
        sampler = AutoModelForCausalLM.from_config(cfg)
    vocab = sampler.config.vocab_size
    sm = megatrain.compile(copy.deepcopy(sampler), optim=OptimConfig(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0))
    prompts = torch.randint(1, vocab, (2, 4))  # two prompts of four tokens
    target = 7
    mean_rewards = []
    for it in range(args.iterations):
        # 1. sample a group of completions per prompt with the current weights
        with torch.no_grad():
            ids = sampler.generate(prompts.repeat_interleave(args.group, 0), do_sample=True, top_k=0,
                                   max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
        completions = ids[:, prompts.shape[1]:]
        rewards = torch.tensor([reward(c.tolist(), target) for c in completions])
        # 2. group-relative advantages, over each completion's length (GRPO's per-token mean)
        groups = rewards.view(-1, args.group)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        weights = adv / completions.shape[1]
        # 3. one streamed step on the completions' tokens, weighted
        labels = ids.clone()
        labels[:, :prompts.shape[1]] = -100  # the prompts are not trained on
        st = sm.train_step(ids, labels=labels, objective=SequenceWeights(), rows={"weights": weights})
        # 4. the new weights to the sampler
        sm.copy_to(sampler)
        mean_rewards.append(float(rewards.mean()))
        print(f"iteration {it + 1}: mean reward {mean_rewards[-1]:.3f}, loss {st.loss:.4f}, grad norm "
              f"{st.grad_norm:.3f}")
    return mean_rewards


if __name__ == "__main__":
    main()
