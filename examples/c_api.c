/* The same library from C99: top-k teacher probabilities from logits, then the loss. */
#include <stdio.h>

#include "lmloss/lmloss.h"

int main(void) {
  float logits[2][5] = {{1.0f, 3.0f, 2.0f, 3.0f, -1.0f}, {0.5f, 0.0f, -2.0f, 4.0f, 1.0f}};
  int32_t labels[2] = {1, 3};
  int32_t ids[2][2];
  float probs[2][2];
  float loss = 0.0f;
  lmloss_context* ctx = NULL;
  if (lmloss_context_create(&ctx) != LMLOSS_SUCCESS) return 1;

  lmloss_head head = {lmloss_tensor_2d(logits, LMLOSS_F32, 2, 5, 0), lmloss_tensor_none(),
                      lmloss_tensor_none(), lmloss_tensor_none()};
  lmloss_topk_options topk = lmloss_topk_options_default();
  topk.k = 2;
  lmloss_tensor ids_t = lmloss_tensor_2d(ids, LMLOSS_I32, 2, 2, 0);
  lmloss_tensor probs_t = lmloss_tensor_2d(probs, LMLOSS_F32, 2, 2, 0);
  lmloss_status status = lmloss_topk(ctx, &head, &topk, &ids_t, &probs_t, NULL);
  if (status != LMLOSS_SUCCESS) {
    fprintf(stderr, "lmloss_topk: %s\n", lmloss_last_error());
    return 1;
  }
  /* Ties go to the lower id: row 0's two 3.0 logits are ids 1 then 3. */
  printf("top-2 of row 0: %d (%.3f), %d (%.3f)\n", ids[0][0], probs[0][0], ids[0][1], probs[0][1]);

  lmloss_targets targets = {lmloss_tensor_1d(labels, LMLOSS_I32, 2), lmloss_tensor_none(),
                            lmloss_tensor_none(), lmloss_tensor_none()};
  lmloss_loss_options options = lmloss_loss_options_default();
  lmloss_tensor loss_t = lmloss_tensor_scalar(&loss, LMLOSS_F32);
  status = lmloss_loss_forward(ctx, &head, &targets, &options, &loss_t, NULL);
  if (status != LMLOSS_SUCCESS) {
    fprintf(stderr, "lmloss_loss_forward: %s\n", lmloss_last_error());
    return 1;
  }
  printf("cross-entropy %.6f\n", loss);
  lmloss_context_destroy(ctx);
  return (ids[0][0] == 1 && ids[0][1] == 3) ? 0 : 1;
}
