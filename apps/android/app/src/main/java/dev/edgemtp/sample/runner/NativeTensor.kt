package dev.edgemtp.sample.runner

import java.nio.ByteBuffer
import java.nio.ByteOrder
import java.nio.FloatBuffer
import java.nio.LongBuffer

/**
 * A tensor crossing the JNI bridge: row-major elements of [dtype] ([FLOAT32] or [INT64]) in a
 * direct buffer of native byte order, starting at the buffer's address (its position is ignored).
 *
 * Buffers the engine hands to [BundleRunner.run] view native memory that lives only during the
 * call; buffers a runner returns are copied by the engine before its next call.
 */
class NativeTensor(
    val name: String,
    val dtype: Int,
    val shape: LongArray,
    val data: ByteBuffer,
) {
    init {
        require(data.isDirect) { "tensor '$name': data must be a direct ByteBuffer" }
        data.order(ByteOrder.nativeOrder()) // JNI's NewDirectByteBuffer starts big-endian
    }

    val elementCount: Int get() = elementCount(shape)

    /** The elements as floats, from the buffer's start; [data] itself is left untouched. */
    fun floats(): FloatBuffer = wholeBuffer().asFloatBuffer()

    /** The elements as longs, from the buffer's start; [data] itself is left untouched. */
    fun longs(): LongBuffer = wholeBuffer().asLongBuffer()

    private fun wholeBuffer(): ByteBuffer =
        data.duplicate().order(ByteOrder.nativeOrder()).also { it.clear() }

    companion object {
        const val FLOAT32 = 0
        const val INT64 = 1

        fun elementCount(shape: LongArray): Int =
            Math.toIntExact(shape.fold(1L) { count, dim -> Math.multiplyExact(count, dim) })

        fun bytesPerElement(dtype: Int): Int = when (dtype) {
            FLOAT32 -> 4
            INT64 -> 8
            else -> throw IllegalArgumentException("dtype code $dtype: the engine takes float32 and int64")
        }

        /** A zeroed tensor over a freshly allocated direct buffer of exactly its bytes. */
        fun allocate(name: String, dtype: Int, shape: LongArray): NativeTensor {
            val bytes = Math.multiplyExact(elementCount(shape), bytesPerElement(dtype))
            return NativeTensor(name, dtype, shape, ByteBuffer.allocateDirect(bytes))
        }

        /** The manifest's dtype names ("float32", "int64") as codes. */
        fun dtypeCode(name: String): Int = when (name) {
            "float32" -> FLOAT32
            "int64" -> INT64
            else -> throw IllegalArgumentException("dtype '$name': the engine takes float32 and int64")
        }
    }
}
