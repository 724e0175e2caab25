/* The C API's enums as a C caller may fill them: C lets an enum hold any int, so the library
 * must refuse a value no enumerator has, with a message, and write nothing. Exit status 0 when
 * every check holds; each failure is printed. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lmloss/lmloss.h"

static int failures = 0;

static void check(int ok, const char* what, int value) {
  if (!ok) {
    fprintf(stderr, "FAILED: %s (value %d)\n", what, value);
    ++failures;
  }
}

static int starts_with(const char* s, const char* prefix) {
  return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* A forward that must be refused with a message starting with `prefix`, its loss not written. */
static void expect_refused(lmloss_context* ctx, const lmloss_head* head, const lmloss_targets* targets,
                           const lmloss_loss_options* options, const char* prefix, int value) {
  float loss = NAN;
  lmloss_tensor loss_t = lmloss_tensor_scalar(&loss, LMLOSS_F32);
  lmloss_status status = lmloss_loss_forward(ctx, head, targets, options, &loss_t, NULL);
  check(status == LMLOSS_ERROR_INVALID_ARGUMENT && isnan(loss) && starts_with(lmloss_last_error(), prefix),
        prefix, value);
}

int main(void) {
  const int values[] = {-1, 7, 99, 1 << 20};
  const int n_values = (int)(sizeof values / sizeof values[0]);
  lmloss_context* ctx = NULL;
  if (lmloss_context_create(&ctx) != LMLOSS_SUCCESS) return 1;

  float logits[2][3] = {{1.0f, 2.0f, 0.5f}, {0.0f, -1.0f, 3.0f}};
  int32_t labels[2] = {1, 2};
  lmloss_head head = {lmloss_tensor_2d(logits, LMLOSS_F32, 2, 3, 0), lmloss_tensor_none(),
                      lmloss_tensor_none(), lmloss_tensor_none()};
  lmloss_targets targets = {lmloss_tensor_1d(labels, LMLOSS_I32, 2), lmloss_tensor_none(),
                            lmloss_tensor_none(), lmloss_tensor_none()};

  for (int i = 0; i < n_values; ++i) {
    const int v = values[i];
    check(lmloss_backend_available((lmloss_device_type)v) == 0, "backend_available", v);
    check(strcmp(lmloss_status_string((lmloss_status)v), "unknown status") == 0, "status_string", v);

    lmloss_loss_options options = lmloss_loss_options_default();
    options.reduction = (lmloss_reduction)v;
    expect_refused(ctx, &head, &targets, &options, "options.reduction: unknown reduction", v);

    options = lmloss_loss_options_default();
    lmloss_targets bad_targets = targets;
    bad_targets.labels.dtype = (lmloss_dtype)v;
    expect_refused(ctx, &head, &bad_targets, &options, "targets.labels: unknown dtype", v);

    lmloss_head bad_head = head;
    bad_head.logits.device_type = (lmloss_device_type)v;
    expect_refused(ctx, &bad_head, &targets, &options, "head.logits: unknown device type", v);
  }
  lmloss_context_destroy(ctx);
  if (failures == 0) printf("unknown enum values refused: %d values, 5 checks each\n", n_values);
  return failures == 0 ? 0 : 1;
}
