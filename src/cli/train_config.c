/*
 * train_config.c — the configurations of `moestash train`: its defaults on
 * each backend, the presets (--preset h100, --preset qwen3-30b-a3b) and
 * --help, which prints every flag with its default on both backends.
 */
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "trainer/run/trainer.h"

/* Defaults: a tiny Qwen3-MoE over bytes on the CPU (200 steps in well
 * under 3 minutes on 2 cores), larger on a GPU so the KEEP vs exact-shapes
 * difference shows. Qwen3-MoE's own defaults where the size does not
 * matter: rms eps 1e-6, router_aux_loss_coef 0.001, norm_topk_prob on,
 * initializer_range 0.02. */
void mst_train_defaults(mst_train_config* t, mst_backend_kind kind) {
    const int gpu = kind == MST_BACKEND_CUDA;
    mst_model_config m = {.vocab = 256, .hidden = gpu ? 512 : 64, .ffn = gpu ? 1024 : 128,
                          .n_head = gpu ? 8 : 4, .n_kv_head = gpu ? 4 : 2, .head_dim = gpu ? 64 : 16,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1,
                          .seq = gpu ? 256 : 64, .batch = gpu ? 16 : 8,
                          .layers = gpu ? 4 : 2, .experts = gpu ? 16 : 8, .top_k = 2, .ep = gpu ? 4 : 2,
                          .capacity_factor = 0.0f /* = --ep */, .mtp_weight = 0.3f, .aux_coef = 0.001f,
                          .norm_eps = 1e-6f, .init_std = 0.02f, .seed = 1};
    mst_optim_config o = {.lr = gpu ? 1e-3f : 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f,
                          .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f, .warmup = 20, .steps = 200};
    memset(t, 0, sizeof *t);
    t->model = m;
    t->optim = o;
    t->microbatches = 1;
    t->steps = 200;
    t->mem = mst_mem_config_default();
    t->graph_from = gpu;
}

static void help(const mst_train_config* c, const mst_train_config* g) {
    printf("usage: moestash train [FLAGS]\n"
           "Trains a Qwen3-MoE language model (transformers' qwen3_moe) with multi-token prediction\n"
           "(a DeepSeek-V3-style MTP module); byte tokens unless --vocab says otherwise.\n"
           "Where two defaults are shown: the CPU backend's / the CUDA backend's.\n"
           "  --backend cpu|cuda        backend (default: cuda when a GPU is present, else cpu)\n"
           "  --steps N                 optimizer steps (%lld)\n"
           "  --seq T                   tokens per sequence (%lld / %lld)\n"
           "  --batch B                 sequences per microbatch (%lld / %lld)\n"
           "  --layers L                transformer layers, each with an MoE block (%d / %d)\n"
           "  --hidden H                model width (%lld / %lld)\n"
           "  --heads NH                query heads (%lld / %lld)\n"
           "  --kv-heads KV             key-value heads (grouped-query attention), must divide NH (%lld / %lld)\n"
           "  --head-dim D              width of each head, even (%lld / %lld)\n"
           "  --rope-theta X            rotary position embedding base (%g)\n"
           "  --norm-topk-prob on|off   the top-k router weights renormalised to sum 1 (on)\n"
           "  --tie-embeddings on|off   the output head is the embedding table (on)\n"
           "  --vocab V                 vocabulary size (%lld: bytes)\n"
           "  --ffn F                   expert MLP width, moe_intermediate_size (SwiGLU, H -> 2F -> H) (%lld / %lld)\n"
           "  --experts E               experts per MoE block (%d / %d)\n"
           "  --top-k K                 experts per token (%d)\n"
           "  --ep G                    expert groups playing expert-parallel ranks, must divide E (%d / %d)\n"
           "  --gpus N                  ranks (1): the experts sharded over N ranks (--ep is N), the rest data-\n"
           "                            parallel; --batch per rank (global batch N B, equal to one rank with\n"
           "                            batch N B and --ep N); cpu: N threads of this process over shared\n"
           "                            memory (the CPU twin); cuda: N processes, one GPU each, over NCCL,\n"
           "                            started by this one (or by torchrun --no-python --nproc-per-node N\n"
           "                            moestash train ...: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)\n"
           "  --pp P                    pipeline stages (1): consecutive layers on P stages of --gpus N / P\n"
           "                            data-parallel ranks each (embedding on the first, final norm, head and\n"
           "                            MTP module on the last; a stage's experts shared by its ranks, --ep N / P);\n"
           "                            1F1B over --microbatches per stage unless --schedule says plain\n"
           "  --capacity-factor C       max_rows per group = ceil(C * tokens * K / G); a group routed more\n"
           "                            rows is over budget and the step reruns with exact shapes\n"
           "                            (default: --ep, the dropless worst case: never over budget)\n"
           "  --microbatches M          microbatches per step, gradients accumulated (%d)\n"
           "  --schedule S              plain | 1f1b | interleaved (2 chunks of layers; --layers + 1 even) (plain)\n"
           "  --policy P                saved grouped-MLP activations: keep | stash | offload | recompute,\n"
           "                            or per tensor: fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep (keep)\n"
           "                            stash and offload take a page format: stash:fp8 (e4m3, a scale per 128\n"
           "                            values, bf16 tensors) or stash:bf16 (= stash, exact)\n"
           "  --recompute R             layer recompute: none | uniform:N | block:N (none); the MTP layer counts\n"
           "                            as the stage's last layer\n"
           "  --recompute-granularity G full: a recomputed layer keeps only its input (norms, attention,\n"
           "                            router, grouped MLP rerun) | moe: only the grouped MLP's tensors (full)\n"
           "  --recompute-mtp           recompute the MTP layer and its module from its two inputs\n"
           "  --memory-budget SIZE      choose keep/stash/offload/recompute per layer and tensor so that the peak\n"
           "                            fits SIZE (20GiB, 512MiB, 1.5GB, bytes) with the least predicted step time;\n"
           "                            prints the plan, predicted and measured peak and step time (replaces\n"
           "                            --policy, --recompute); on --gpus N one plan for every rank, from the\n"
           "                            max over the ranks of what each rank's probe measured; with --pp P each\n"
           "                            stage plans its own layers and schedule, SIZE for each rank\n"
           "  --check-policies          train --steps under every policy and layer recompute; check losses and\n"
           "                            final weights are bit-identical; one line each, exit 1 if not\n"
           "  --pool-factor X           stash pool pages over the measured peak (1.1; below 1 forces overflows)\n"
           "  --mtp-weight W            weight of the multi-token-prediction loss (%g)\n"
           "  --aux-coef A              load-balancing loss coefficient, router_aux_loss_coef (%g); the loss is\n"
           "                            transformers' over the main layers of each microbatch (--aux-weight: the same)\n"
           "  --lr LR                   peak learning rate, warmup then cosine to 10%% (%g / %g)\n"
           "  --warmup N                warmup steps (%lld)\n"
           "  --data FILE               train on a text file (bytes) or an llm.c .bin token file (magic 20240520)\n"
           "                            (default: built-in synthetic corpus)\n"
           "  --seed S                  seed of weights and data (%llu)\n"
           "  --graph on|off            replay each sized step from one captured CUDA graph (cpu: off / cuda: on)\n"
           "  --adam-moments fp32|bf16  AdamW's first and second moments stored fp32, or bf16 as DeepSeek-V3 trains\n"
           "                            (updated in fp32, stored rounded to nearest even; the master weights stay\n"
           "                            fp32): 8 bytes of optimizer state a parameter instead of 12 (fp32)\n"
           "  --optimizer-shard on|off  ZeRO-1 on --gpus N: the replicated parameters' fp32 master weights and AdamW\n"
           "                            moments sharded over the N ranks (gradients reduce-scattered, bf16 weights\n"
           "                            all-gathered); checkpoints hold the state whole, resumable either way (off)\n"
           "  --overlap on|off          --gpus N: each layer's replicated gradients summed over the ranks once the\n"
           "                            step's last backward of the layer is done, on a stream of their own under the\n"
           "                            next layers' backward (off: all after the backward; the same bits either way,\n"
           "                            with --optimizer-shard on too: a layer's part of each rank's block\n"
           "                            reduce-scattered); off by default: on 4 x H200 (NVLink) it was 1.01-1.04x slower,\n"
           "                            the all-reduce being 1-2.5 %% of the step (off)\n"
           "  --attention A             flash: fused, saves the output and row logsumexp | cublas: saves the T x T\n"
           "                            probabilities (cuBLAS on cuda) | cudnn: cuDNN's fused attention (cuda;\n"
           "                            saves what flash saves; loads libcudnn.so.9 or $MST_CUDNN_LIB) | auto:\n"
           "                            cudnn where it loads and takes the dims, else flash where the backend\n"
           "                            takes the head dim (cuda: 64 or 128), else cublas (auto)\n"
           "  --log-every N             a progress line every N steps (1)\n"
           "  --preset NAME             h100: H 2048, 16 query / 4 key-value heads of dim 128, 8 layers, 64 experts\n"
           "                            top-4, F 1024, T 2048, B 2, ep 1, 8 microbatches, 1f1b;\n"
           "                            qwen3-30b-a3b: Qwen3-30B-A3B's published configuration: 48 layers, H 2048,\n"
           "                            32 query / 4 key-value heads of dim 128, 128 experts top-8, F 768, vocab\n"
           "                            151936, rope theta 1e6, untied head, T 2048, B 1, 8 microbatches, 1f1b\n"
           "                            (fit it with --layers N, --gpus N; flags given after a preset override it)\n"
           "  --json FILE               write losses, timings and the memory table as JSON\n"
           "  --save DIR                checkpoints: DIR/step-N every --save-every N steps and DIR/final,\n"

           "                            each a Hugging Face model directory (config.json, model.safetensors with\n"
           "                            the hub's names; transformers' from_pretrained reads it) with the MTP\n"
           "                            module (mtp.safetensors), optimizer state and trainer.json beside it;\n"
           "                            refused before any work when the filesystem has no room for one\n"
           "  --save-every N            0: DIR/final only (0)\n"
           "  --save-shard SIZE         shard the tensor files above SIZE (5GB; model.safetensors.index.json)\n"
           "  --init-from DIR           start from the weights of a Hugging Face Qwen3-MoE directory (config.json,\n"
           "                            model.safetensors or its index; F32, BF16 or F16), fresh optimizer; the\n"
           "                            model's shape is its config.json's (a flag that contradicts it is refused)\n"
           "  --dump-grads FILE         after step 1's backward, before its optimizer: every parameter's fp32\n"
           "                            main_grad by its hub name (MTP: DeepSeek-V3's), \"tokens\" I32 [M B, T+2]\n"
           "                            (the step's windows), F32 [1] \"loss_main\", \"loss_mtp\", \"loss_aux\"\n"
           "                            and the main head's \"logits\" F32 [M B T, V] into a safetensors FILE (one rank)\n"
           "  --resume DIR              continue the run of checkpoint DIR with its stored configuration\n"
           "                            (--steps, --save, --json, --plot, --graph, --log-every, --quiet may be given)\n"
           "  --eval-data FILE          held-out text or .bin tokens for evaluation\n"
           "  --eval-fraction F         hold out the last F of --data instead (0 < F < 1)\n"
           "  --eval-every N            evaluate every N steps and at the end (0: at the end)\n"
           "  --eval-batches N          batches per evaluation (8)\n"
           "  --plot FILE.svg           draw the train and eval losses\n"
           "  --timeline FILE.svg       draw the backend memory of one step by category (and FILE-keep.svg: KEEP)\n"
           "  --force-over-budget STEP  flag STEP over budget once to exercise the rerun (0: off)\n"
           "  --force-overflow STEP     flag STEP as a stash-pool overflow once (0: off)\n"
           "  --quiet                   no progress lines\n",
           (long long)c->steps, (long long)c->model.seq, (long long)g->model.seq,
           (long long)c->model.batch, (long long)g->model.batch, c->model.layers, g->model.layers,
           (long long)c->model.hidden, (long long)g->model.hidden, (long long)c->model.n_head,
           (long long)g->model.n_head, (long long)c->model.n_kv_head, (long long)g->model.n_kv_head,
           (long long)c->model.head_dim, (long long)g->model.head_dim, (double)c->model.rope_theta,
           (long long)c->model.vocab, (long long)c->model.ffn, (long long)g->model.ffn,
           c->model.experts, g->model.experts, c->model.top_k, c->model.ep, g->model.ep,
           c->microbatches, (double)c->model.mtp_weight,
           (double)c->model.aux_coef, (double)c->optim.lr, (double)g->optim.lr, (long long)c->optim.warmup,
           (unsigned long long)c->model.seed);
}

/* --preset h100: the model of the whole-step benchmark, sized for one
 * 80 GB card: H 2048, 16 query heads of dim 128 over 4 key-value heads,
 * 8 layers, 64 experts top-4 of F 1024, T 2048. Its 3.7 G parameters take
 * 67 GB with their gradients and AdamW state (18 bytes each), which leaves
 * room for B 2 with one group (ep 1, capacity factor 1: dropless and never
 * over budget); 8 microbatches under 1F1B (one set of activations in
 * flight) make 32768 tokens a step, so the optimizer's pass over the
 * parameters is paid once per 8 microbatches.
 * --preset qwen3-30b-a3b: the published Qwen3-30B-A3B configuration (its
 * config.json): 30.5 G parameters, 31.1 G with the MTP layer, 524 GiB
 * with their gradients and AdamW state: --layers N and --gpus N size it to
 * the machine. The other flags still override either. */
int mst_train_preset(mst_args* a, mst_train_config* t, const char** name) {
    static const char* const presets[] = {"h100", "qwen3-30b-a3b", NULL};
    int which = 0, rc = mst_args_choice(a, presets, &which);
    if (rc) return rc;
    *name = presets[which];
    mst_model_config* m = &t->model;
    m->hidden = 2048, m->n_head = 16, m->n_kv_head = 4, m->head_dim = 128, m->layers = 8, m->experts = 64;
    m->top_k = 4, m->ffn = 1024, m->seq = 2048, m->batch = 2, m->ep = 1;
    if (which == 1) {
        m->vocab = 151936, m->layers = 48, m->n_head = 32, m->experts = 128, m->top_k = 8, m->ffn = 768;
        m->rope_theta = 1e6f, m->norm_topk_prob = 1, m->tie_embeddings = 0, m->norm_eps = 1e-6f, m->batch = 1;
    }
    t->microbatches = 8, t->mem.schedule = MST_SCHEDULE_1F1B;
    return 0;
}

void mst_train_help(void) {
    mst_train_config c, g;
    mst_train_defaults(&c, MST_BACKEND_CPU);
    mst_train_defaults(&g, MST_BACKEND_CUDA);
    help(&c, &g);
}
