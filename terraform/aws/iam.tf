# Least-privilege IAM policies for cloudckpt. Every action below is one the S3 adapter
# (cloudckpt/stores/s3.py) calls; the table in terraform/README.md maps each action to the
# code path that needs it. Resources are the bucket and the objects under var.run_prefix.

locals {
  policy_name_prefix = coalesce(var.policy_name_prefix, var.bucket_name)
  objects_arn        = var.run_prefix == "" ? "${aws_s3_bucket.this.arn}/*" : "${aws_s3_bucket.this.arn}/${var.run_prefix}/*"
  run_url_prefix     = var.run_prefix == "" ? "s3://${aws_s3_bucket.this.bucket}/" : "s3://${aws_s3_bucket.this.bucket}/${var.run_prefix}/"
  kms_key_arns       = var.kms_key_arn == null ? [] : [var.kms_key_arn]
}

# --- writer: the training role (save, resume, commit; GC too if writer_can_delete) -----------

data "aws_iam_policy_document" "writer" {
  # s3:ListBucket covers ListObjectsV2 (S3Store.list: finding attempts, commits/ records,
  # "is the run empty" before a claim; S3Store.now and _check_bucket: a one-key listing of
  # the run prefix for the store clock). Every listing carries the run prefix, so the
  # statement is narrowed to it with an s3:prefix condition.
  #
  # The condition is StringLikeIfExists, not StringLike, because S3 also consults
  # s3:ListBucket to answer a GetObject/HeadObject of a missing key: 404 with it, 403
  # without (https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html,
  # "Permissions"). That request has no s3:prefix, and a plain StringLike on an absent key
  # is false (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_condition_operators.html#Conditions_IfExists),
  # so a new run's first read of LATEST would be denied (PermissionDeniedError) instead of
  # "no LATEST yet". IfExists lets such requests count; a listing that names a prefix must
  # still name one under the run prefix. (The price: a listing with no prefix at all is
  # allowed too, so key names, not contents, elsewhere in the bucket become listable.)
  statement {
    sid       = "ListCheckpointBucket"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    dynamic "condition" {
      for_each = var.run_prefix == "" ? [] : [1]
      content {
        test     = "StringLikeIfExists" # see the writer policy above: 404, not 403
        variable = "s3:prefix"
        values   = ["${var.run_prefix}/*"]
      }
    }
  }

  # s3:GetObject: GetObject and HeadObject (LATEST, MANIFEST.json, data files, ranged reads).
  # s3:PutObject: PutObject (data files, MANIFEST.json create-only, LATEST compare-and-swap,
  #   commits/ records) and CreateMultipartUpload / UploadPart / CompleteMultipartUpload.
  # s3:AbortMultipartUpload: a failed or cancelled upload releases its parts.
  statement {
    sid = "ReadWriteRunObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:AbortMultipartUpload",
    ]
    resources = [local.objects_arn]
  }

  dynamic "statement" {
    for_each = var.writer_can_delete ? [1] : []
    content {
      sid       = "GarbageCollectRunObjects"
      actions   = ["s3:DeleteObject"]
      resources = [local.objects_arn]
    }
  }

  dynamic "statement" {
    for_each = var.writer_can_delete ? [1] : []
    content {
      sid       = "FindIncompleteUploads"
      actions   = ["s3:ListBucketMultipartUploads"]
      resources = [aws_s3_bucket.this.arn]
    }
  }

  dynamic "statement" {
    for_each = length(local.kms_key_arns) > 0 ? [1] : []
    content {
      sid       = "UseBucketKmsKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = local.kms_key_arns
    }
  }
}

resource "aws_iam_policy" "writer" {
  name        = "${local.policy_name_prefix}-cloudckpt-writer"
  description = "cloudckpt training writer: save, commit and resume checkpoints under ${local.run_url_prefix}"
  policy      = data.aws_iam_policy_document.writer.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "writer" {
  count = var.writer_role_name == null ? 0 : 1

  role       = var.writer_role_name
  policy_arn = aws_iam_policy.writer.arn
}

# --- restore: read-only (restore on a new host, ls, show, verify) ---------------------------
# Not enough for `cloudckpt gc --dry-run`: GC lists incomplete multipart uploads
# (s3:ListBucketMultipartUploads), which a read-only role does not need otherwise.

data "aws_iam_policy_document" "restore" {
  statement {
    sid       = "ListCheckpointBucket"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    dynamic "condition" {
      for_each = var.run_prefix == "" ? [] : [1]
      content {
        test     = "StringLikeIfExists" # see the writer policy above: 404, not 403
        variable = "s3:prefix"
        values   = ["${var.run_prefix}/*"]
      }
    }
  }

  statement {
    sid       = "ReadRunObjects"
    actions   = ["s3:GetObject"]
    resources = [local.objects_arn]
  }

  dynamic "statement" {
    for_each = length(local.kms_key_arns) > 0 ? [1] : []
    content {
      sid       = "DecryptWithBucketKmsKey"
      actions   = ["kms:Decrypt"]
      resources = local.kms_key_arns
    }
  }
}

resource "aws_iam_policy" "restore" {
  count = var.create_restore_policy ? 1 : 0

  name        = "${local.policy_name_prefix}-cloudckpt-restore"
  description = "cloudckpt read-only: restore and inspect checkpoints under ${local.run_url_prefix}"
  policy      = data.aws_iam_policy_document.restore.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "restore" {
  count = var.create_restore_policy && var.restore_role_name != null ? 1 : 0

  role       = var.restore_role_name
  policy_arn = aws_iam_policy.restore[0].arn
}

# --- gc: the garbage collector (cloudckpt gc) ---------------------------------------------
# GC reads LATEST, marks tombstones "deleting" in LATEST (a compare-and-swap put), deletes
# manifests and files, and aborts incomplete multipart uploads past the grace period.

data "aws_iam_policy_document" "gc" {
  statement {
    sid       = "ListCheckpointBucket"
    actions   = ["s3:ListBucket", "s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid = "CollectRunObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = [local.objects_arn]
  }

  dynamic "statement" {
    for_each = length(local.kms_key_arns) > 0 ? [1] : []
    content {
      sid       = "UseBucketKmsKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = local.kms_key_arns
    }
  }
}

resource "aws_iam_policy" "gc" {
  count = var.create_gc_policy ? 1 : 0

  name        = "${local.policy_name_prefix}-cloudckpt-gc"
  description = "cloudckpt garbage collector for ${local.run_url_prefix}"
  policy      = data.aws_iam_policy_document.gc.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "gc" {
  count = var.create_gc_policy && var.gc_role_name != null ? 1 : 0

  role       = var.gc_role_name
  policy_arn = aws_iam_policy.gc[0].arn
}
